"""Runs vLLM for the benchmark inside vLLM's own environment (a separate venv).

Started as `<vllm venv>/bin/python vllm_driver.py '<json config>'`; it imports nothing
from PageLLM, only vLLM and the standard library, because PageLLM is not installed
there. It speaks JSON lines: every line it means for the harness starts with MARK
(vLLM logs to stdout too). First `{"ready": true, "startup_s": ...}`; then for each
request line `{"prompts": [[ids]], "max_tokens": n, "ignore_eos": bool}` one result
line, with each request's token times; `{"quit": true}` ends it.
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


def _run_stepwise(llm: Any, prompts: list[list[int]], params: Any,
                  prefix: str) -> list[dict[str, Any]]:
    """Drives vLLM's engine step by step, noting when each request's tokens appear, so
    TTFT and inter-token latency are measured as they are for PageLLM (vLLM's offline
    `generate` keeps no per-token times). Times are seconds since this call started."""
    engine = llm.llm_engine
    start = time.perf_counter()
    ids = [f"{prefix}-{index}" for index in range(len(prompts))]
    for index, prompt in enumerate(prompts):  # no zip(strict=): vLLM's Python may be older
        engine.add_request(ids[index], {"prompt_token_ids": prompt}, params)
    times: dict[str, list[float]] = {request_id: [] for request_id in ids}
    final: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter() - start
            seen = times[output.request_id]
            count = len(output.outputs[0].token_ids) if output.outputs else 0
            seen.extend([now] * (count - len(seen)))
            if output.finished:
                final[output.request_id] = output
    return [{"output_ids": list(final[r].outputs[0].token_ids),
             "cached_tokens": getattr(final[r], "num_cached_tokens", None),
             "token_times_s": times[r]} for r in ids]


def main() -> None:
    config = json.loads(sys.argv[1])
    begin = time.perf_counter()
    from vllm import LLM, SamplingParams

    kwargs = dict(model=config["model"], dtype="float32", seed=0,
                  enable_prefix_caching=config["enable_prefix_caching"],
                  max_num_seqs=config["max_num_seqs"],
                  max_num_batched_tokens=config["max_num_batched_tokens"])
    # vLLM's CPU attention needs blocks in multiples of 32; elsewhere vLLM keeps its default.
    block_size = config.get("block_size", 16)
    if block_size % 32 == 0:
        kwargs["block_size"] = block_size
    if config.get("max_model_len"):  # a small pool's (see vllm_runner.vllm_max_model_len)
        kwargs["max_model_len"] = config["max_model_len"]
    if config.get("kv_cache_memory_bytes"):
        kwargs["kv_cache_memory_bytes"] = config["kv_cache_memory_bytes"]
    llm = LLM(**kwargs)
    warmup = config.get("warmup") or [1, 2, 3, 4]
    llm.generate([{"prompt_token_ids": warmup}], SamplingParams(temperature=0, max_tokens=2),
                 use_tqdm=False)
    if hasattr(llm, "reset_prefix_cache"):
        llm.reset_prefix_cache()
    cache_config = llm.llm_engine.vllm_config.cache_config
    _emit({"ready": True, "startup_s": time.perf_counter() - begin,
           "kv_pool_tokens": (cache_config.num_gpu_blocks or 0) * cache_config.block_size,
           "version": getattr(sys.modules.get("vllm"), "__version__", "?")})
    calls = 0
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            return
        params = SamplingParams(temperature=0, max_tokens=command["max_tokens"],
                                ignore_eos=command.get("ignore_eos", True))
        start = time.perf_counter()
        results = _run_stepwise(llm, command["prompts"], params, f"call{calls}")
        calls += 1
        _emit({"wall_s": time.perf_counter() - start, "results": results})


if __name__ == "__main__":
    main()
