"""Hugging Face transformers as contenders, on the same converted weights, float32.

Two ways a transformers user would serve a batch: `generate` on left-padded batches (the
classic way: every request of a batch waits for the longest, no KV sharing), and
continuous batching (`generate_batch`, paged KV with block sharing), where this
transformers version has it.
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path
from typing import Any, cast

import torch

from pagellm.bench.contender import GenerateRequest
from pagellm.bench.metrics import RequestRecord
from pagellm.bench.pagellm_runner import kv_bytes_per_token


def _load_model(model_dir: Path, num_threads: int | None, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    if num_threads:
        torch.set_num_threads(num_threads)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.to(device).eval()
    return model


def _generation_config(model: Any, request: GenerateRequest) -> Any:
    """Greedy, `max_tokens` new tokens. transformers fills an unset `eos_token_id` from
    the model's own config, so ignoring EOS means naming an id that can never be
    generated (one past the vocabulary) rather than None."""
    from transformers import GenerationConfig

    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = eos[0] if isinstance(eos, list) else eos
    if request.ignore_eos:
        eos = model.config.vocab_size
    return cast(Any, GenerationConfig)(max_new_tokens=request.max_tokens, do_sample=False,
                            eos_token_id=eos, pad_token_id=pad if pad is not None else 0)


class _StepClock:
    """A transformers streamer that only notes when each decoding step's tokens exist.

    `generate` calls `put` once with the prompt, then once per step with that step's
    tokens for the whole batch; those times are every row's token times.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        return None


def _trim(ids: list[int], eos: set[int], ignore_eos: bool) -> list[int]:
    """A row's generated ids up to and including its first EOS (the rest is padding)."""
    if ignore_eos:
        return ids
    for index, token in enumerate(ids):
        if token in eos:
            return ids[: index + 1]
    return ids


class HFGenerateContender:
    """`model.generate` on batches of `batch_size` left-padded prompts, one after another
    (batch_size 1: one request at a time)."""

    def __init__(self, name: str, model_dir: Path, batch_size: int = 8,
                 num_threads: int | None = None, device: str = "cpu") -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.name = name
        self._model_dir = model_dir
        self._batch_size = batch_size
        self._threads = num_threads
        self._device = device
        self._model: Any = None

    def start(self, kv_cache_tokens: int | None, warmup: list[int]) -> float:
        begin = time.perf_counter()
        self._model = _load_model(self._model_dir, self._threads, self._device)
        self._generate_batch([warmup], GenerateRequest([warmup], 2))
        return time.perf_counter() - begin

    def _generate_batch(self, prompts: list[list[int]],
                        request: GenerateRequest) -> tuple[list[list[int]], list[float]]:
        config = _generation_config(self._model, request)
        width = max(len(p) for p in prompts)
        pad = config.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts],
                                 device=self._device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=self._device)
        clock = _StepClock()
        with torch.inference_mode():
            output = self._model.generate(input_ids=input_ids, attention_mask=mask,
                                          generation_config=config, streamer=clock)
        eos = config.eos_token_id
        eos_set = set(eos) if isinstance(eos, list) else {eos}
        rows = [_trim(row[width:], eos_set, request.ignore_eos) for row in output.tolist()]
        return rows, clock.times

    def generate(self, request: GenerateRequest, origin: float) -> list[RequestRecord]:
        arrival = time.perf_counter() - origin
        prompts = [list(p) for p in request.prompts]
        records = []
        for start in range(0, len(prompts), self._batch_size):
            batch = prompts[start : start + self._batch_size]
            rows, times = self._generate_batch(batch, request)
            times = [t - origin for t in times]
            for prompt, ids in zip(batch, rows, strict=True):
                own = times[: len(ids)]
                records.append(RequestRecord(
                    prompt_len=len(prompt), output_len=len(ids), output_ids=ids,
                    arrival=arrival, first_token=own[0], finish=own[-1], token_times=own,
                    cached_tokens=0))
        return records

    def process_id(self) -> int | None:
        return None

    def stats(self) -> dict[str, Any]:
        return {"batch_size": self._batch_size}

    def timings(self) -> dict[str, float] | None:
        return None

    def close(self) -> None:
        self._model = None
        gc.collect()


def has_continuous_batching() -> bool:
    """Whether the installed transformers has `generate_batch` (continuous batching)."""
    from transformers import GenerationMixin

    return hasattr(GenerationMixin, "generate_batch")


class HFContinuousBatchingContender:
    """transformers' own continuous batching (`generate_batch`), with block sharing on.

    The manager is kept between calls (multi-turn rounds), as a server would keep it, so
    its cache can serve later turns. Its pool is `pool_bytes` of float32 (the bench's
    `--kv-cache-memory-bytes`, else PageLLM's default pool, 1 GiB), or the workload's
    `kv_cache_tokens` where it asks for a small pool.
    """

    def __init__(self, name: str, model_dir: Path, page_size: int = 256,
                 max_batch_tokens: int = 2048, pool_bytes: int = 1 << 30,
                 num_threads: int | None = None, device: str = "cpu") -> None:
        self.name = name
        self._model_dir = model_dir
        self._page_size = page_size
        self._max_batch_tokens = max_batch_tokens
        self._pool_tokens = pool_bytes // kv_bytes_per_token(model_dir)
        self._threads = num_threads
        self._device = device
        self._model: Any = None

    @property
    def _num_pages(self) -> int:
        """Whole pages of the pool, rounded down: rounding up gave transformers a larger
        pool than the other engines (23,552 tokens against PageLLM's 23,296)."""
        return max(self._pool_tokens // self._page_size, 2)

    def start(self, kv_cache_tokens: int | None, warmup: list[int]) -> float:
        # Keeping the manager between rounds is deliberate; its warning on every call is not
        # news to a benchmark.
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
        begin = time.perf_counter()
        self._model = _load_model(self._model_dir, self._threads, self._device)
        if kv_cache_tokens is not None:
            self._pool_tokens = kv_cache_tokens
        self._run([warmup], GenerateRequest([warmup], 2), persistent=False)
        return time.perf_counter() - begin

    def _run(self, prompts: list[list[int]], request: GenerateRequest,
             persistent: bool = True) -> dict[str, Any]:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        config = _generation_config(self._model, request)
        cb_config = ContinuousBatchingConfig(
            page_size=self._page_size,
            num_blocks=self._num_pages,
            max_batch_tokens=self._max_batch_tokens, allow_block_sharing=True)
        outputs: dict[str, Any] = self._model.generate_batch(
            prompts, generation_config=config, continuous_batching_config=cb_config,
            record_timestamps=True, progress_bar=False, persistent_manager=persistent)
        return outputs

    def generate(self, request: GenerateRequest, origin: float) -> list[RequestRecord]:
        # Every request arrives as the call starts, as for the other contenders (not at
        # `created_time`, which transformers stamps once it has built the call's manager:
        # that time is the request's wait too).
        arrival = time.perf_counter() - origin
        prompts = [list(p) for p in request.prompts]
        outputs = self._run(prompts, request)
        config = _generation_config(self._model, request)
        eos = config.eos_token_id
        eos_set = set(eos) if isinstance(eos, list) else {eos}
        by_order = sorted(outputs.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
        records = []
        for prompt, output in zip(prompts, by_order, strict=True):
            if output.error:
                raise RuntimeError(f"{self.name}: {output.error}")
            ids = _trim(list(output.generated_tokens), eos_set, request.ignore_eos)
            times = [t - origin for t in (output.timestamps or [])][: len(ids)]
            records.append(RequestRecord(
                prompt_len=len(prompt), output_len=len(ids), output_ids=ids, arrival=arrival,
                first_token=times[0] if times else output.lifespan[1] - origin,
                finish=output.lifespan[1] - origin, token_times=times))
        return records

    def process_id(self) -> int | None:
        return None

    def stats(self) -> dict[str, Any]:
        return {"page_size": self._page_size,
                "kv_pool_tokens": self._num_pages * self._page_size}

    def timings(self) -> dict[str, float] | None:
        return None

    def close(self) -> None:
        if self._model is not None:
            self._model.destroy_cached_continuous_batching_manager()
        self._model = None
        gc.collect()
