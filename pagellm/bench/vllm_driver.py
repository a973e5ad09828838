"""Runs vLLM for the benchmark inside vLLM's own environment (a separate venv).

Started as `<vllm venv>/bin/python vllm_driver.py '<json config>'`; it imports nothing
from PageLLM, only vLLM and the standard library, because PageLLM is not installed
there. It speaks JSON lines: every line it means for the harness starts with MARK
(vLLM logs to stdout too). First `{"ready": true, "startup_s": ...}`; then for each
request line `{"prompts": [[ids]], "max_tokens": n, "ignore_eos": bool}` one result
line; `{"quit": true}` ends it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

MARK = "@@pagellm-bench@@ "


def _emit(payload: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


def _first_token_s(output: Any, call_start_wall: float,
                   call_start_mono: float) -> float | None:
    """Seconds from the call's start to the request's first token, from whichever
    metrics this vLLM version keeps (the v0 and v1 engines name and clock them
    differently), or None."""
    metrics = getattr(output, "metrics", None)
    first = getattr(metrics, "first_token_time", None) if metrics is not None else None
    if first is None:
        first = getattr(metrics, "first_token_ts", None) if metrics is not None else None
    if not first:
        return None
    for origin in (call_start_mono, call_start_wall):
        delta = float(first) - origin
        if 0 <= delta < 86400:
            return delta
    return None


def main() -> None:
    config = json.loads(sys.argv[1])
    begin = time.perf_counter()
    from vllm import LLM, SamplingParams

    kwargs = dict(model=config["model"], dtype="float32", seed=0,
                  enable_prefix_caching=config["enable_prefix_caching"],
                  block_size=config.get("block_size", 16),
                  max_num_seqs=config.get("max_num_seqs", 64),
                  max_num_batched_tokens=config.get("max_num_batched_tokens", 2048))
    if config.get("kv_cache_memory_bytes"):
        kwargs["kv_cache_memory_bytes"] = config["kv_cache_memory_bytes"]
    try:
        llm = LLM(**kwargs)
    except TypeError:
        # Versions without kv_cache_memory_bytes size the CPU pool from
        # VLLM_CPU_KVCACHE_SPACE, which the harness sets in the environment.
        kwargs.pop("kv_cache_memory_bytes", None)
        llm = LLM(**kwargs)
    warmup = config.get("warmup") or [1, 2, 3, 4]
    llm.generate([{"prompt_token_ids": warmup}], SamplingParams(temperature=0, max_tokens=2),
                 use_tqdm=False)
    if hasattr(llm, "reset_prefix_cache"):
        llm.reset_prefix_cache()
    _emit({"ready": True, "startup_s": time.perf_counter() - begin,
           "version": getattr(sys.modules.get("vllm"), "__version__", "?")})
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            return
        params = SamplingParams(temperature=0, max_tokens=command["max_tokens"],
                                ignore_eos=command.get("ignore_eos", True))
        start_wall, start_mono, start = time.time(), time.monotonic(), time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in command["prompts"]], params,
                               use_tqdm=False)
        wall = time.perf_counter() - start
        _emit({"wall_s": wall, "results": [
            {"output_ids": list(o.outputs[0].token_ids),
             "cached_tokens": getattr(o, "num_cached_tokens", None),
             "first_token_s": _first_token_s(o, start_wall, start_mono)}
            for o in outputs]})


if __name__ == "__main__":
    main()
