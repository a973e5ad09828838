"""Many clients at once, and clients that leave: right answers, no leaked KV blocks."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai

from tests.server.conftest import MODEL_NAME, REPORT, Server

NUM_CLIENTS = 64
MAX_TOKENS = 8
# A greedy token may legitimately differ where two candidates are this close: round-off
# differs between a request computed alone and inside a batch (the engine suite's rule).
NEAR_TIE = 1e-3
SYSTEM_PROMPT = ("You are the assistant of a load test. Reply with a short, friendly and "
                 "factual sentence about the topic the user names, and nothing else. ") * 2
TOPICS = ["the sea", "a mountain", "bread", "the moon", "a violin", "rain", "a library",
          "coffee"]


def request(index: int) -> dict[str, Any]:
    return dict(model=MODEL_NAME, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                top_logprobs=2, messages=[
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": f"Topic: {TOPICS[index % len(TOPICS)]}."}])


async def stream_one(client: openai.AsyncOpenAI, index: int) -> tuple[str, list[str]]:
    """The streamed text and tokens of one client's request."""
    stream = await client.chat.completions.create(stream=True, **request(index))
    text: list[str] = []
    tokens: list[str] = []
    async for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            if choice.logprobs is not None and choice.logprobs.content:
                tokens.extend(t.token for t in choice.logprobs.content)
    return "".join(text), tokens


def assert_same_greedy(streamed: tuple[str, list[str]], reference: Any, label: str) -> None:
    """Streamed output equals the non-streamed one, except after a true near-tie."""
    text, tokens = streamed
    content = reference.choices[0].logprobs.content
    ref_tokens = [t.token for t in content]
    if tokens == ref_tokens:
        assert text == reference.choices[0].message.content, label
        return
    first = next(i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=False)) if a != b)
    alternatives = {t.token: t.logprob for t in content[first].top_logprobs}
    gap = abs(alternatives.get(tokens[first], float("-inf")) - content[first].logprob)
    assert gap < NEAR_TIE, f"{label}: differs at token {first}: {tokens} vs {ref_tokens}"


def test_concurrent_streaming_clients(server: Server) -> None:
    before = server.wait_idle()

    async def run() -> list[tuple[str, list[str]]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                      max_retries=0, timeout=300) as client:
            return await asyncio.gather(*[stream_one(client, i) for i in range(NUM_CLIENTS)])

    started = time.perf_counter()
    streamed = asyncio.run(run())
    seconds = time.perf_counter() - started
    during = server.wait_idle()
    queries = during["pagellm_prefix_cache_queries_total"] - before["pagellm_prefix_cache_queries_total"]
    hits = during["pagellm_prefix_cache_hits_total"] - before["pagellm_prefix_cache_hits_total"]
    REPORT.append(
        f"load test: {NUM_CLIENTS} concurrent streaming clients x {MAX_TOKENS} tokens in "
        f"{seconds:.1f} s, prefix cache hit rate {hits / queries:.1%} "
        f"({int(hits)}/{int(queries)} prompt tokens), preemptions so far "
        f"{int(during['pagellm_num_preemptions_total'])}")
    assert hits > 0
    assert "prefix cache hit rate" in server.log_text

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    references = {i: client.chat.completions.create(**request(i)) for i in range(len(TOPICS))}
    for index, result in enumerate(streamed):
        assert result[0], f"client {index} got no text"
        assert_same_greedy(result, references[index % len(TOPICS)], f"client {index}")
    server.wait_idle()


def test_disconnect_mid_stream_aborts_and_frees_blocks(server: Server) -> None:
    before = server.wait_idle()
    body = {"model": MODEL_NAME, "prompt": "Write a very long story about a dragon.",
            "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = 0
        for line in lines:
            received += line.startswith("data: ")
            if received == 3:
                break
        assert server.metrics()["pagellm_kv_cache_usage"] > 0
    after = server.wait_idle(timeout=20)
    generated = after["pagellm_generation_tokens_total"] - before["pagellm_generation_tokens_total"]
    assert generated < 400, "the request ran to completion instead of being aborted"

    def grew(name: str) -> float:
        return after[name] - before[name]

    # Counted as aborted, and the first token it streamed counts as a time to first token.
    assert grew('pagellm_request_finished_total{finished_reason="abort"}') == 1
    assert grew('pagellm_request_finished_total{finished_reason="length"}') == 0
    assert grew("pagellm_time_to_first_token_seconds_count") == 1
    assert grew("pagellm_e2e_request_latency_seconds_count") == 0


def test_disconnect_while_waiting_for_a_non_streamed_answer(server: Server) -> None:
    before = server.wait_idle()
    body = {"model": MODEL_NAME, "prompt": "Write a very long story about a knight.",
            "max_tokens": 400, "ignore_eos": True}
    try:
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.5)
    except httpx.TimeoutException:
        pass
    after = server.wait_idle(timeout=20)
    generated = after["pagellm_generation_tokens_total"] - before["pagellm_generation_tokens_total"]
    assert generated < 400, "the request ran to completion instead of being aborted"
