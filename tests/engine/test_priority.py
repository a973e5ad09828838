"""vLLM's priority scheduling through the engine: lower values run first, tokens are the
reference's, and a priority without the policy is refused rather than ignored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagellm import LLM, SamplingParams
from tests.engine.conftest import assert_greedy_equal, assert_idle, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_priority_policy_runs_lower_values_first(tiny: Path, reference: Any) -> None:
    llm = LLM(str(tiny), device="cpu", skip_tokenizer_init=True, cpu_kernels=False,
              scheduling_policy="priority", max_num_seqs=1, kv_cache_memory_bytes=1 << 20)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                           priority=[2, 0, 1], use_tqdm=False)
    first_tokens = [out.metrics.first_token_time for out in outputs]
    assert first_tokens[1] < first_tokens[2] < first_tokens[0]
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_greedy_equal(reference, prompt, list(out.outputs[0].token_ids),
                            hf_greedy(reference, prompt, 4), "priority")
    assert_idle(llm.llm_engine)


def test_a_priority_needs_the_priority_policy(tiny: Path) -> None:
    llm = LLM(str(tiny), device="cpu", skip_tokenizer_init=True, cpu_kernels=False,
              kv_cache_memory_bytes=1 << 20)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        llm.generate(prompt, GREEDY, priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        llm.generate(prompt, GREEDY, priority=[0, 0], use_tqdm=False)
    assert llm.generate(prompt, GREEDY, priority=[0], use_tqdm=False)[0].outputs
    assert_idle(llm.llm_engine)
