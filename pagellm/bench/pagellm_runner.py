"""PageLLM itself as a contender, in process, through the offline `LLM` API."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

from pagellm.bench.contender import GenerateRequest
from pagellm.bench.metrics import RequestRecord
from pagellm.core.kv_cache_manager import blocks_for_tokens
from pagellm.core.sampling_params import SamplingParams
from pagellm.engine.llm import LLM
from pagellm.model.model_config import load_model_config

_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_evictions", "num_preemptions",
             "prompt_tokens", "generation_tokens", "prompt_tokens_computed")


def kv_bytes_per_token(model_dir: Path, element_size: int = 4) -> int:
    """K and V of one token in every layer, in bytes (float32 by default)."""
    return int(load_model_config(model_dir).kv_cache_bytes_per_token(element_size))


def kv_cache_bytes_for_tokens(model_dir: Path, tokens: int, block_size: int) -> int:
    """The `kv_cache_memory_bytes` that gives a pool of at least `tokens` slots, rounded
    up to whole blocks, of float32 (the eviction workload sizes pools in tokens, vLLM in
    bytes)."""
    return blocks_for_tokens(tokens, block_size) * block_size * kv_bytes_per_token(model_dir)


def kv_element_size(engine_kwargs: dict[str, Any]) -> int:
    """Bytes of one PageLLM KV pool element under these engine options, at most: 2 where
    `kv_cache_dtype` is bfloat16, else 4 ("auto" is float32, or bfloat16 where the loaded
    model's attention rounds to it). A pool given in tokens goes in blocks
    (`blocks_for_tokens`), so holds as many either way."""
    return 2 if engine_kwargs.get("kv_cache_dtype") == "bfloat16" else 4


class PageLLMContender:
    """`LLM.generate` on the whole list, prefix caching on or off."""

    def __init__(self, name: str, model_dir: Path, enable_prefix_caching: bool,
                 engine_kwargs: dict[str, Any] | None = None) -> None:
        self.name = name
        self._model_dir = model_dir
        self._caching = enable_prefix_caching
        self._kwargs = dict(engine_kwargs or {})
        self._llm: LLM | None = None
        self._base_stats: dict[str, Any] = {}
        self._base_timings: dict[str, float] = {}

    @property
    def llm(self) -> LLM:
        if self._llm is None:
            raise RuntimeError(f"{self.name} is not started")
        return self._llm

    def start(self, kv_cache_tokens: int | None, warmup: list[int]) -> float:
        kwargs = dict(self._kwargs)
        if kv_cache_tokens is not None:
            kwargs.pop("kv_cache_memory_bytes", None)
            kwargs["num_gpu_blocks_override"] = blocks_for_tokens(
                kv_cache_tokens, kwargs.get("block_size", 16))
        begin = time.perf_counter()
        self._llm = LLM(str(self._model_dir), enable_prefix_caching=self._caching,
                        dtype="float32", **kwargs)
        self.llm.generate([{"prompt_token_ids": warmup}],
                          SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        self.llm.reset_prefix_cache()
        startup = time.perf_counter() - begin
        stats = self.llm.llm_engine.get_stats()
        self._base_stats = {name: getattr(stats, name) for name in _COUNTERS}
        self._base_timings = dict(stats.timings)
        return startup

    def generate(self, request: GenerateRequest, origin: float) -> list[RequestRecord]:
        params = SamplingParams(temperature=0, max_tokens=request.max_tokens,
                                ignore_eos=request.ignore_eos)
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in request.prompts],
                                    params, use_tqdm=False)
        # Engine metrics are time.monotonic(); the harness counts from a perf_counter().
        shift = time.perf_counter() - time.monotonic() - origin
        records = []
        for output in outputs:
            if output.error is not None:
                raise RuntimeError(f"{self.name}: a benchmark prompt was rejected: {output.error}")
            metrics = output.metrics
            assert metrics is not None and metrics.first_token_time is not None
            ids = list(output.outputs[0].token_ids)
            records.append(RequestRecord(
                prompt_len=len(output.prompt_token_ids), output_len=len(ids), output_ids=ids,
                arrival=metrics.arrival_time + shift,
                first_token=metrics.first_token_time + shift,
                finish=(metrics.finished_time or metrics.last_token_time or 0.0) + shift,
                token_times=[t + shift for t in metrics.token_times],
                cached_tokens=output.num_cached_tokens))
        return records

    def process_id(self) -> int | None:
        return None

    def stats(self) -> dict[str, Any]:
        stats = self.llm.llm_engine.get_stats()
        delta = {name: getattr(stats, name) - self._base_stats.get(name, 0)
                 for name in _COUNTERS}
        queries = delta["prefix_cache_queries"]
        delta["prefix_cache_hit_rate"] = delta["prefix_cache_hits"] / queries if queries else 0.0
        delta["num_blocks"] = stats.num_blocks
        delta["block_size"] = self.llm.llm_engine.config.block_size
        delta["kv_pool_tokens"] = stats.num_blocks * delta["block_size"]
        # What "auto" resolved to: under int8 activations it may be bfloat16.
        delta["kv_pool_dtype"] = str(self.llm.llm_engine.kv_cache_dtype).removeprefix("torch.")
        return delta

    def timings(self) -> dict[str, float] | None:
        now = self.llm.llm_engine.get_stats().timings
        return {k: v - self._base_timings.get(k, 0.0) for k, v in now.items()}

    def close(self) -> None:
        self._llm = None
        gc.collect()
