"""The engine on a CUDA device: the same exactness and leak rules as on the CPU.

Skipped where torch sees no GPU (CI has none); `scripts/gpu_check.sh` runs it on one. The
reference stays transformers on the CPU in float32, so a CUDA run is checked against the
same numbers the CPU engine is. Decode steps replay CUDA graphs unless `enforce_eager`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pagellm import LLM, SamplingParams
from tests.engine.conftest import assert_greedy_equal, assert_idle, hf_greedy
from tests.engine.test_cuda_graphs import check_shrinking_batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BF16_GAP = 0.25
"""A bfloat16 run may part from the float32 reference only where the reference's two
candidate tokens are this close in log-probability (bf16 keeps 8 bits of mantissa)."""


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(2, 384) for _ in range(45)]
    return [prefix + [rng.randrange(2, 384) for _ in range(n)] for n in (1, 7, 16, 30)]


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_idle(llm.llm_engine)
    return [list(out.outputs[0].token_ids) for out in outputs]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("caching", [True, False], ids=["cache-on", "cache-off"])
def test_float32_matches_cpu_reference(caching: bool, tiny: Path, reference: Any) -> None:
    llm = LLM(str(tiny), device="cuda", skip_tokenizer_init=True, block_size=8,
              enable_prefix_caching=caching, kv_cache_memory_bytes=4 << 20)
    assert llm.llm_engine.kv_cache.tensors[0].device.type == "cuda"
    prompts = _prompts(3)
    refs = [hf_greedy(reference, p, 12) for p in prompts]
    for warm in (False, True):
        for prompt, ours, ref in zip(prompts, _generate(llm, prompts, _greedy(12)), refs,
                                     strict=True):
            assert_greedy_equal(reference, prompt, ours, ref, f"cuda caching={caching} {warm=}")
    hits = llm.llm_engine.get_stats().prefix_cache_hits
    assert (hits > 0) == caching


def test_preemption_on_cuda(tiny: Path, reference: Any) -> None:
    """A pool of 14 blocks for four requests that need more: preempted requests resume from
    the cache and still give the reference's tokens."""
    llm = LLM(str(tiny), device="cuda", skip_tokenizer_init=True, block_size=8,
              kv_cache_memory_bytes=512 * 8 * 14)
    prompts = _prompts(11)[:3]
    outputs = _generate(llm, prompts, _greedy(24))
    assert llm.llm_engine.get_stats().num_preemptions > 0
    for prompt, ours in zip(prompts, outputs, strict=True):
        assert_greedy_equal(reference, prompt, ours, hf_greedy(reference, prompt, 24),
                            "cuda preemption")


def test_bfloat16_parts_only_at_near_ties(tiny: Path, reference: Any) -> None:
    llm = LLM(str(tiny), device="cuda", dtype="bfloat16", skip_tokenizer_init=True,
              block_size=8, kv_cache_memory_bytes=4 << 20)
    assert llm.llm_engine.kv_cache.tensors[0].dtype == torch.bfloat16
    prompts = _prompts(5)
    for prompt, ours in zip(prompts, _generate(llm, prompts, _greedy(8)), strict=True):
        ref = hf_greedy(reference, prompt, 8)
        first = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b),
                     None)
        if first is None:
            continue
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + ref[:first]])).logits[0, -1]
        logprobs = torch.log_softmax(logits, dim=-1)
        gap = abs(float(logprobs[ours[first]] - logprobs[ref[first]]))
        assert gap < BF16_GAP, f"bf16 parts from float32 at {first} with gap {gap:.3f}"


def test_seeded_sampling_is_reproducible_on_cuda(tiny: Path) -> None:
    llm = LLM(str(tiny), device="cuda", skip_tokenizer_init=True,
              kv_cache_memory_bytes=4 << 20)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=16,
                            ignore_eos=True)
    prompts = _prompts(9)
    first = _generate(llm, prompts, params)
    assert _generate(llm, prompts, params) == first
    assert len({tuple(tokens) for tokens in first}) > 1


def test_shared_prefix_on_cuda_skips_the_cascade(tiny: Path, reference: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU step is bound by kernel launches, so a shared prefix is attended with each
    request's own keys, not through the CPU's cascade; the tokens still match."""
    from pagellm.model.attention import TorchBatchedBackend

    def refuse(*args: Any) -> torch.Tensor:
        raise AssertionError("the cascade ran on CUDA")

    monkeypatch.setattr(TorchBatchedBackend, "_attend_cascade", refuse)
    llm = LLM(str(tiny), device="cuda", skip_tokenizer_init=True, block_size=8,
              kv_cache_memory_bytes=4 << 20)
    prompts = _prompts(17)
    for warm in (False, True):
        for prompt, ours in zip(prompts, _generate(llm, prompts, _greedy(10)), strict=True):
            assert_greedy_equal(reference, prompt, ours, hf_greedy(reference, prompt, 10),
                                f"cuda shared prefix {warm=}")
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0


def test_decode_graphs_replay_every_batch_shape(tiny: Path, reference: Any) -> None:
    """Real CUDA graphs, one per (padded batch, table width), sharing one memory pool and
    replayed in any order, give the reference's tokens; so does the eager engine."""
    llm = LLM(str(tiny), device="cuda", skip_tokenizer_init=True, block_size=8,
              max_num_seqs=6, kv_cache_memory_bytes=4 << 20)
    check_shrinking_batches(llm, reference)
    eager = LLM(str(tiny), device="cuda", skip_tokenizer_init=True, block_size=8,
                max_num_seqs=6, kv_cache_memory_bytes=4 << 20, enforce_eager=True)
    assert eager.llm_engine.runner.graphs is None
    prompts = _prompts(23)
    graphed = _generate(llm, prompts, _greedy(16))
    for prompt, ours, eager_tokens in zip(prompts, graphed, _generate(eager, prompts,
                                                                      _greedy(16)), strict=True):
        ref = hf_greedy(reference, prompt, 16)
        assert_greedy_equal(reference, prompt, ours, ref, "cuda graphs")
        assert_greedy_equal(reference, prompt, eager_tokens, ref, "cuda eager")


def test_gpu_memory_utilization_sizes_the_pool_from_the_whole_card(tiny: Path) -> None:
    """vLLM's meaning: the engine's share of the card, less what the engine took of it
    (a tiny model: little), whatever else the card holds."""
    _free, total = torch.cuda.mem_get_info()
    llm = LLM(str(tiny), device="cuda", skip_tokenizer_init=True, gpu_memory_utilization=0.05)
    pool = sum(t.numel() * t.element_size() for t in llm.llm_engine.kv_cache.tensors)
    assert 0.03 * total < pool <= 0.051 * total, (pool, total)  # + the padding block
    prompts = _prompts(5)
    assert len(_generate(llm, prompts, _greedy(4))) == len(prompts)
