"""vLLM's priority scheduling through the engine: lower values run first, tokens are the
reference's, and a priority without the policy is refused rather than ignored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
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
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):  # a list too
        llm.generate([prompt, prompt], GREEDY, priority=[1, 1], use_tqdm=False)
    assert llm.generate(prompt, GREEDY, priority=[0], use_tqdm=False)[0].outputs
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        LLM(str(tiny), scheduling_policy="lifo")
    assert_idle(llm.llm_engine)


def test_priorities_may_be_numpy_integers_but_not_other_things(tiny: Path) -> None:
    llm = LLM(str(tiny), device="cpu", skip_tokenizer_init=True, cpu_kernels=False,
              scheduling_policy="priority", kv_cache_memory_bytes=1 << 20)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    outputs = llm.generate(prompts, GREEDY, priority=np.array([1, 0]), use_tqdm=False)
    assert all(out.error is None for out in outputs)
    for bad in (1.5, "high", True):
        with pytest.raises(ValueError, match="priority must be an integer"):
            llm.generate(prompts, GREEDY, priority=[0, bad], use_tqdm=False)
    assert_idle(llm.llm_engine)


def test_generate_input_runs_the_best_priority_line_first(tiny: Path) -> None:
    """`pagellm generate --input` runs one line alone first (to cache a shared prefix):
    under the priority policy that is the best-priority line, not the first."""
    from pagellm.entrypoints.generate import Job, run_jobs

    llm = LLM(str(tiny), device="cpu", skip_tokenizer_init=True, cpu_kernels=False,
              scheduling_policy="priority", max_num_seqs=1, kv_cache_memory_bytes=1 << 20)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    jobs = [Job(i, {}, token_ids=p, priority=q)
            for i, (p, q) in enumerate(zip(prompts, [5, 0, 1], strict=True))]
    first = {job.index: output.metrics.first_token_time
             for job, output in run_jobs(llm.llm_engine, jobs, GREEDY, progress=False)
             if output is not None}
    assert first[1] < first[2] < first[0]
    assert_idle(llm.llm_engine)
