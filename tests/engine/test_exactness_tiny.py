"""Greedy outputs equal the transformers reference, cache on and off, on tiny random models
of every supported architecture and through every scheduling path (shared prefixes, block
boundaries, chunked prefill, preemption)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pagellm import LLM, BeamSearchParams, SamplingParams
from tests.engine.conftest import assert_greedy_equal, assert_idle, hf_greedy, make_tiny_model

ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa-untied": ("llama", {}),
    "llama-mha-tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama-rope-llama3": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 16}),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_tiny_model(root / name, arch, **kw)
            for name, (arch, kw) in ARCHS.items()}


@pytest.fixture(scope="module")
def hf_models(tiny_models: dict[str, Path]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for name, path in tiny_models.items()}


def _prompts(seed: int, prefix_len: int, suffix_lens: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(2, 384) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(2, 384) for _ in range(n)] for n in suffix_lens]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _llm(path: Path, **kwargs: Any) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 4 << 20)
    return LLM(str(path), skip_tokenizer_init=True, **kwargs)


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(max_tokens),
                           use_tqdm=False)
    assert_idle(llm.llm_engine)
    return outputs


@pytest.mark.parametrize("caching", [True, False], ids=["cache-on", "cache-off"])
@pytest.mark.parametrize("name", list(ARCHS))
def test_architectures_match_reference(name: str, caching: bool, tiny_models: dict[str, Path],
                                       hf_models: dict[str, Any]) -> None:
    llm = _llm(tiny_models[name], enable_prefix_caching=caching)
    prompts = _prompts(7, 40, [3, 9, 17])
    refs = [hf_greedy(hf_models[name], p, 10) for p in prompts]
    for warm in (False, True):
        outputs = _run(llm, prompts, 10)
        for prompt, out, ref in zip(prompts, outputs, refs, strict=True):
            assert_greedy_equal(hf_models[name], prompt, out.outputs[0].token_ids, ref,
                                f"{name} caching={caching} warm={warm}")
        if warm and caching:
            assert all(out.num_cached_tokens >= 32 for out in outputs)
        if not caching:
            assert all(out.num_cached_tokens == 0 for out in outputs)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_boundaries(block_size: int, tiny_models: dict[str, Path],
                          hf_models: dict[str, Any]) -> None:
    """Prompts of k*bs - 1, k*bs and k*bs + 1 tokens, each twice: the second run hits the
    cache up to (len - 1) rounded down to a block, and the output does not change."""
    name = "llama-gqa-untied"
    llm = _llm(tiny_models[name], block_size=block_size)
    rng = random.Random(block_size)
    for length in (3 * block_size - 1, 3 * block_size, 3 * block_size + 1):
        prompt = [rng.randrange(2, 384) for _ in range(length)]
        ref = hf_greedy(hf_models[name], prompt, 2 * block_size + 1)
        for attempt in range(2):
            (out,) = _run(llm, [prompt], 2 * block_size + 1)
            assert_greedy_equal(hf_models[name], prompt, out.outputs[0].token_ids, ref,
                                f"bs={block_size} len={length} attempt={attempt}")
            expected = 0 if attempt == 0 else (length - 1) // block_size * block_size
            assert out.num_cached_tokens == expected


@pytest.mark.parametrize("caching, threshold", [(True, 0), (False, 0), (True, 3)],
                         ids=["cache-on", "cache-off", "long-prefill-threshold"])
def test_chunked_prefill_tiny_budget(caching: bool, threshold: int,
                                     tiny_models: dict[str, Path],
                                     hf_models: dict[str, Any]) -> None:
    """Prompts cut into chunks by a tiny step budget (or by vLLM's
    long_prefill_token_threshold, several requests' chunks a step) give the reference's
    tokens."""
    name = "qwen2-bias"
    llm = _llm(tiny_models[name], enable_prefix_caching=caching, max_num_batched_tokens=7,
               block_size=8, long_prefill_token_threshold=threshold)
    prompts = _prompts(3, 30, [5, 11, 2, 20])
    outputs = _run(llm, prompts, 9)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_greedy_equal(hf_models[name], prompt, out.outputs[0].token_ids,
                            hf_greedy(hf_models[name], prompt, 9), f"chunked caching={caching}")


def test_a_budget_below_max_num_seqs_warns_and_still_serves_everyone(
        tiny_models: dict[str, Path], hf_models: dict[str, Any],
        caplog: pytest.LogCaptureFixture) -> None:
    """vLLM refuses a step budget below max_num_seqs; here it is taken, with a warning.
    It caps the requests admitted, but a request's n samples fork past it, so some
    running samples wait out a step, and every one still decodes to the reference."""
    name = "llama-gqa-untied"
    with caplog.at_level("WARNING", logger="pagellm.engine.llm_engine"):
        llm = _llm(tiny_models[name], max_num_batched_tokens=3, block_size=8)
    assert "max_num_batched_tokens (3) is below max_num_seqs (64)" in caplog.text
    scheduler = llm.llm_engine.scheduler
    schedule = scheduler.schedule
    left_out = []

    def counting() -> Any:
        output = schedule()
        left_out.append(len(scheduler.running) - len(output.scheduled))
        return output

    scheduler.schedule = counting  # type: ignore[method-assign]
    prompts = _prompts(7, 6, [2, 3, 4])
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(n=4, temperature=0, max_tokens=5, ignore_eos=True),
                           use_tqdm=False)
    assert max(left_out) > 0  # running samples beyond the budget waited for a later step
    for prompt, out in zip(prompts, outputs, strict=True):
        reference = hf_greedy(hf_models[name], prompt, 5)
        assert len(out.outputs) == 4
        for sample in out.outputs:
            assert_greedy_equal(hf_models[name], prompt, sample.token_ids, reference,
                                "budget 3, n=4")
    assert_idle(llm.llm_engine)


@pytest.mark.parametrize("caching", [True, False], ids=["cache-on", "cache-off"])
def test_preemption_and_resume(caching: bool, tiny_models: dict[str, Path],
                               hf_models: dict[str, Any]) -> None:
    """A pool too small for all requests at once: some are preempted, resumed (mostly from
    the cache when it is on) and still produce the reference tokens."""
    name = "llama-gqa-untied"
    path = tiny_models[name]
    # 2 layers x 2 kv heads x 16 dims x 2 (K, V) x 4 bytes = 512 bytes per token.
    llm = _llm(path, enable_prefix_caching=caching, block_size=8,
               kv_cache_memory_bytes=512 * 8 * 14)
    assert llm.llm_engine.kv_manager.num_blocks == 14
    prompts = _prompts(11, 16, [4, 6, 8, 10])
    outputs = _run(llm, prompts, 24)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_greedy_equal(hf_models[name], prompt, out.outputs[0].token_ids,
                            hf_greedy(hf_models[name], prompt, 24), f"preempt caching={caching}")
    # The benchmark's "prompt tokens computed" counts the prompts computed again after a
    # preemption too: prompt minus cached (what it reported) left them out.
    first_pass = sum(len(p) for p in prompts) - sum(o.num_cached_tokens for o in outputs)
    assert stats.prompt_tokens_computed > first_pass
    # vLLM's iteration_tokens leaves the recomputation out too (a prompt's tokens count
    # once, when its first token is out); PageLLM's own series counts every step's work.
    latencies = stats.latencies
    assert latencies.output_iteration_tokens.sum == first_pass + 24 * len(prompts)
    assert latencies.iteration_tokens.sum > latencies.output_iteration_tokens.sum


def test_same_prompt_twice_in_one_batch(tiny_models: dict[str, Path],
                                        hf_models: dict[str, Any]) -> None:
    name = "qwen3-qk-norm"
    llm = _llm(tiny_models[name], block_size=8)
    prompt = _prompts(5, 37, [0])[0]
    outputs = _run(llm, [prompt, prompt, prompt], 8)
    ref = hf_greedy(hf_models[name], prompt, 8)
    for out in outputs:
        assert_greedy_equal(hf_models[name], prompt, out.outputs[0].token_ids, ref, "twice")


def test_seeded_sampling_same_alone_and_in_batch(tiny_models: dict[str, Path]) -> None:
    llm = _llm(tiny_models["llama-gqa-untied"])
    prompts = _prompts(9, 20, [1, 5, 9])
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=12,
                            ignore_eos=True)
    (alone,) = llm.generate([{"prompt_token_ids": prompts[1]}], seeded, use_tqdm=False)
    others = SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True)
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         [others, seeded, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_idle(llm.llm_engine)


def test_n_samples_share_prompt_blocks(tiny_models: dict[str, Path],
                                       hf_models: dict[str, Any]) -> None:
    """n > 1 forks from one prefill: the children hold the parent's full prompt blocks
    (ref counted), and greedy children all equal the reference."""
    name = "llama-gqa-untied"
    llm = _llm(tiny_models[name], block_size=8)
    engine = llm.llm_engine
    prompt = _prompts(13, 21, [0])[0]
    engine.add_request("fork", {"prompt_token_ids": prompt},
                       SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()
    tables = [engine.kv_manager.get_block_ids(r) for r in
              (engine.scheduler.requests[f"fork#{i}"] for i in range(3))]
    full = len(prompt) // 8
    assert tables[0][:full] == tables[1][:full] == tables[2][:full]
    assert len({t[full] for t in tables}) == 3, "the partial block must be copied, not shared"
    for block_id in tables[0][:full]:
        assert engine.kv_manager.pool.blocks[block_id].ref_count == 3
    outputs: list[Any] = []
    while engine.has_unfinished_requests():
        outputs.extend(o for o in engine.step() if o.finished)
    ref = hf_greedy(hf_models[name], prompt, 6)
    assert [c.token_ids for c in outputs[0].outputs] == [ref, ref, ref]
    assert_idle(engine)


def test_an_id_its_samples_would_take_refuses_the_request_and_changes_nothing(
        tiny_models: dict[str, Path]) -> None:
    """n > 1 names its samples "id#k": a caller's request already holding one of those
    names (or asking for one a sample holds) is refused, and every request goes on."""
    engine = _llm(tiny_models["llama-gqa-untied"]).llm_engine
    prompt = {"prompt_token_ids": _prompts(14, 10, [0])[0]}
    two = SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a#1", prompt, _greedy(4))
    with pytest.raises(ValueError, match="request id 'a#1' is already in use"):
        engine.add_request("a", prompt, two)
    engine.add_request("b", prompt, SamplingParams(n=2, temperature=0, max_tokens=4,
                                                   ignore_eos=True, seed=0))
    with pytest.raises(ValueError, match="request id 'b#0' is already in use"):
        engine.add_request("b#0", prompt, _greedy(4))
    outputs = [o for _ in iter(engine.has_unfinished_requests, False) for o in engine.step()
               if o.finished]
    assert sorted((o.request_id, len(o.outputs)) for o in outputs) == [("a#1", 1), ("b", 2)]
    assert all(len(c.token_ids) == 4 for o in outputs for c in o.outputs)
    # A sample that has finished keeps its id while the rest of its group runs: the seed
    # (sample k draws with seed + k) where c#0 stops at its first token and c#1 does not.
    for seed in range(40):
        engine.add_request("c", prompt, SamplingParams(n=2, temperature=1, max_tokens=8,
                                                       seed=seed,
                                                       stop_token_ids=list(range(192))))
        engine.step()
        if "c#0" not in engine.scheduler.requests and "c#1" in engine.scheduler.requests:
            break
        engine.abort_request("c")
    else:
        pytest.fail("no seed stopped one sample alone")
    with pytest.raises(ValueError, match="request id 'c#0' is already in use"):
        engine.add_request("c#0", prompt, _greedy(4))
    finished = [o for _ in iter(engine.has_unfinished_requests, False) for o in engine.step()
                if o.finished]
    assert [(o.request_id, len(o.outputs)) for o in finished] == [("c", 2)]
    assert_idle(engine)


def test_a_forks_block_copy_happens_even_when_its_step_fails(
        tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy-on-write copy of a fork's partial block is due in the step after the
    fork; a sibling not scheduled in that step (a budget below max_num_seqs) would go on
    without it if a failure before the forward pass dropped it."""
    engine = _llm(tiny_models["llama-gqa-untied"], block_size=8).llm_engine
    engine.add_request("fork", {"prompt_token_ids": _prompts(15, 10, [0])[0]},
                       SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    copies = [(c.src, c.dst) for c in engine.scheduler._pending_copies]
    assert copies

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("broken forward")

    monkeypatch.setattr(engine.runner, "execute", broken)
    outputs = engine.step()
    assert outputs and all(o.error and "broken forward" in o.error for o in outputs)
    for src, dst in copies:
        for layer in engine.kv_cache.tensors:
            assert torch.equal(layer[:, dst], layer[:, src])
    assert_idle(engine)


def test_bad_prompt_in_batch_does_not_stop_the_others(tiny_models: dict[str, Path]) -> None:
    llm = _llm(tiny_models["llama-gqa-untied"], max_model_len=64)
    good = _prompts(1, 10, [0])[0]
    outputs = llm.generate([{"prompt_token_ids": good}, {"prompt_token_ids": [5] * 100},
                            {"prompt_token_ids": []}], _greedy(4), use_tqdm=False)
    assert outputs[0].error is None and len(outputs[0].outputs[0].token_ids) == 4
    assert "max_model_len" in (outputs[1].error or "")
    assert "empty" in (outputs[2].error or "")
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 100}, _greedy(4), use_tqdm=False)
    assert_idle(llm.llm_engine)
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate(None, _greedy(4), use_tqdm=False)  # type: ignore[arg-type]
    assert_idle(llm.llm_engine)


def test_token_ids_from_numpy_and_torch(tiny_models: dict[str, Path]) -> None:
    """Ids from a dataset or a tokenizer's return_tensors run as the same plain list."""
    import numpy as np

    llm = _llm(tiny_models["llama-gqa-untied"])
    ids = _prompts(2, 20, [0])[0]
    (plain,) = llm.generate({"prompt_token_ids": ids}, _greedy(4), use_tqdm=False)
    forms = (np.array(ids), torch.tensor(ids), [np.int64(i) for i in ids], tuple(ids))
    for form in forms:
        # Bare, and in a prompt dict: one prompt either way.
        for prompt in (form, {"prompt_token_ids": form}):
            (out,) = llm.generate(prompt, _greedy(4), use_tqdm=False)
            assert out.prompt_token_ids == ids
            assert all(type(i) is int for i in out.prompt_token_ids)
            assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    batch = llm.generate(np.array([ids, ids]), _greedy(4), use_tqdm=False)  # 2-D: a batch
    batch += llm.generate([np.array(ids), torch.tensor(ids)], _greedy(4), use_tqdm=False)
    ragged = np.empty(2, dtype=object)  # a dataset column of token-id arrays
    ragged[:] = [np.array(ids), np.array(ids[:-1])]
    batch += llm.generate(ragged, _greedy(4), use_tqdm=False)[:1]
    assert [o.outputs[0].token_ids for o in batch] == [plain.outputs[0].token_ids] * 5
    with pytest.raises(ValueError, match="must be integers, got 1.5"):
        llm.generate({"prompt_token_ids": [1, 1.5]}, _greedy(4), use_tqdm=False)
    # A 1-D array is one prompt even when it cannot be one: one error, not one per value.
    for bad, message in ((np.array([5.0, 6.0]), "got 5.0"), (torch.tensor([5.0]), "got 5.0"),
                         (np.array([], dtype=np.int64), "empty")):
        with pytest.raises(ValueError, match=message):
            llm.generate(bad, _greedy(4), use_tqdm=False)
    assert_idle(llm.llm_engine)


def test_reset_prefix_cache_answers_false_while_requests_run(tiny_models: dict[str, Path]
                                                             ) -> None:
    """vLLM's contract: a reset with blocks in use changes nothing and says so."""
    llm = _llm(tiny_models["llama-gqa-untied"])
    prompt = _prompts(3, 40, [0])[0]
    llm.generate({"prompt_token_ids": prompt}, _greedy(2), use_tqdm=False)
    engine = llm.llm_engine
    engine.add_request("running", {"prompt_token_ids": prompt}, _greedy(4))
    engine.step()
    assert llm.reset_prefix_cache() is False
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().prefix_cache_hits > 0  # the cache was kept and hit
    assert llm.reset_prefix_cache() is True
    (again,) = llm.generate({"prompt_token_ids": prompt}, _greedy(2), use_tqdm=False)
    assert again.num_cached_tokens == 0
    assert_idle(engine)


def test_generate_beside_requests_added_to_the_engine(tiny_models: dict[str, Path]) -> None:
    """generate's requests are numbered by the engine: one added directly as "0" (or
    with an engine-chosen id) neither takes a prompt's slot nor makes it fail."""
    llm = _llm(tiny_models["llama-gqa-untied"])
    engine = llm.llm_engine
    direct = _prompts(5, 12, [0])[0]
    engine.add_request("0", {"prompt_token_ids": direct}, _greedy(9))
    chosen = engine.add_request(None, {"prompt_token_ids": direct}, _greedy(9))
    assert chosen != "0"
    prompts = _prompts(6, 10, [1, 2])
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(4),
                           use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert all(o.error is None and len(o.outputs[0].token_ids) == 4 for o in outputs)
    assert {o.request_id for o in outputs}.isdisjoint({"0", chosen})
    assert_idle(engine)


def test_prompt_tokens_count_once_the_prompt_is_computed(tiny_models: dict[str, Path]
                                                          ) -> None:
    """As vLLM counts them: a queued prompt is not prefill done, and one aborted before
    its first token never is; n > 1 counts the shared prompt once."""
    engine = _llm(tiny_models["llama-gqa-untied"]).llm_engine
    prompt = _prompts(1, 20, [3])[0]
    engine.add_request("kept", {"prompt_token_ids": prompt}, _greedy(3))
    engine.add_request("dropped", {"prompt_token_ids": prompt}, _greedy(3))
    engine.add_request("pair", {"prompt_token_ids": prompt}, SamplingParams(
        n=2, temperature=1.0, seed=1, max_tokens=2))
    assert engine.get_stats().prompt_tokens == 0
    engine.abort_request("dropped")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().prompt_tokens == 2 * len(prompt)
    assert_idle(engine)


def test_the_engine_records_every_request_it_ends(tiny_models: dict[str, Path]) -> None:
    """The latency histograms and finish reasons are the engine's, so they count a
    request aborted after its first token though nobody read an output of it (a client
    that left at once), each completion of an n = 2 request, and a beam search once,
    as a request of beam_width completions, not once per step of its beams."""
    engine = _llm(tiny_models["llama-gqa-untied"]).llm_engine
    prompt = _prompts(1, 20, [5])[0]
    engine.add_request("left", {"prompt_token_ids": prompt}, _greedy(8))
    engine.step()  # the prompt and the first token
    # Recorded as the token is generated (as vLLM does), not when the request ends.
    assert engine.get_stats().latencies.time_to_first_token.count == 1
    (last,) = engine.abort_request("left")
    assert last.finished and last.outputs[0].finish_reason == "abort"
    engine.add_request("pair", {"prompt_token_ids": prompt}, SamplingParams(
        n=2, temperature=1.0, seed=1, max_tokens=3, ignore_eos=True))
    engine.add_request("search", {"prompt_token_ids": prompt},
                       BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    latencies = engine.get_stats().latencies
    assert latencies.requests_finished == {"abort": 1, "length": 2 + 2}
    assert latencies.time_to_first_token.count == 1 + 2 + 2
    assert latencies.inter_token_latency.count == 0 + 2 * 2 + 2 * 2
    assert latencies.e2e_request_latency.count == 2 + 2  # none for the abort
    metrics = {(m.name, m.labels.get("finished_reason")): m for m in engine.get_metrics()}
    assert metrics[("vllm:request_success", "length")].value == 4  # type: ignore[attr-defined]
    # vLLM's sizes and phases of the finished ones: per completion, n per request.
    sizes = {name: (h.count, h.sum) for name, h in (
        ("prompt", latencies.prompt_tokens), ("generated", latencies.generation_tokens),
        ("n", latencies.params_n), ("most", latencies.max_num_generation_tokens),
        ("max_tokens", latencies.params_max_tokens))}
    assert sizes == {"prompt": (4, 4 * len(prompt)), "generated": (4, 12), "n": (2, 4),
                     "most": (2, 6), "max_tokens": (4, 12)}
    assert all(h.count == 4 for h in (latencies.queue_time, latencies.prefill_time,
                                      latencies.decode_time, latencies.inference_time))
    steps = latencies.iteration_tokens
    assert steps.count >= 4 and steps.sum >= len(prompt)
    info = metrics[("vllm:cache_config_info", None)]
    assert info.labels["block_size"] == str(engine.config.block_size)
    assert info.labels["enable_prefix_caching"] == "True"
    assert info.labels["gpu_memory_utilization"] == "None"  # the pool was sized in bytes
    blocks = engine.get_stats().num_blocks
    assert info.labels["kv_cache_size_tokens"] == str(blocks * engine.config.block_size)
    assert latencies.num_preemptions.count == 4 and latencies.num_preemptions.sum == 0
    waiting = {m.labels.get("reason"): m.value  # type: ignore[attr-defined]
               for m in engine.get_metrics() if m.name == "vllm:num_requests_waiting_by_reason"}
    assert waiting == {"capacity": 0, "deferred": 0}
    assert_idle(engine)


def test_debug_logging_says_where_a_prompt_departs(tiny_models: dict[str, Path]) -> None:
    """As the README says to turn it on, in a fresh process (no handler installed yet):
    with the `pagellm` logger at DEBUG before LLM(...), the engine keeps what it needs
    to say where a prompt left the closest cached one, and prints it."""
    prompt = _prompts(8, 40, [0])[0]
    departing = prompt[:21] + [(t % 380) + 3 for t in prompt[21:]]
    script = f"""
import logging
logging.getLogger("pagellm").setLevel(logging.DEBUG)
from pagellm import LLM, SamplingParams
llm = LLM({str(tiny_models["llama-gqa-untied"])!r}, skip_tokenizer_init=True,
          kv_cache_memory_bytes=4 << 20)
params = SamplingParams(temperature=0, max_tokens=1)
llm.generate([{{"prompt_token_ids": {prompt}}}], params, use_tqdm=False)
llm.generate([{{"prompt_token_ids": {departing}}}], params, use_tqdm=False)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "16 of 40 prompt tokens from the prefix cache" in result.stderr
    assert "the prompt departs from a cached one at token 21" in result.stderr


def test_cache_salt_in_the_prompt_dict_keys_the_blocks(tiny_models: dict[str, Path]) -> None:
    """vLLM puts the salt in the prompt dict; ported code must keep its isolation."""
    from pagellm import TokensPrompt

    llm = _llm(tiny_models["llama-gqa-untied"], block_size=8)
    ids = _prompts(3, 40, [0])[0]
    llm.generate({"prompt_token_ids": ids}, _greedy(1), use_tqdm=False)
    salted = TokensPrompt(prompt_token_ids=ids, cache_salt="tenant-a")
    (first,) = llm.generate(salted, _greedy(1), use_tqdm=False)
    (again,) = llm.generate(salted, _greedy(1), use_tqdm=False)
    (unsalted,) = llm.generate({"prompt_token_ids": ids}, _greedy(1), use_tqdm=False)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert unsalted.num_cached_tokens > 0
    with pytest.raises(ValueError, match="cache_salt is given twice"):
        llm.generate(salted, _greedy(1), use_tqdm=False, cache_salt="tenant-b")
    with pytest.raises(ValueError, match="'multi_modal_data' is not supported"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {}}, _greedy(1),
                     use_tqdm=False)
    assert_idle(llm.llm_engine)


def test_without_a_tokenizer_text_features_are_refused(tiny_models: dict[str, Path]) -> None:
    llm = _llm(tiny_models["llama-gqa-untied"])
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match="chat needs the model's tokenizer"):
        llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
    assert_idle(llm.llm_engine)


def test_max_model_len_beyond_the_model_is_refused(tiny_models: dict[str, Path]) -> None:
    """As in vLLM: asking for more context than the model has is an error, not a clamp."""
    with pytest.raises(ValueError, match="max_model_len is 100000.*512"):
        _llm(tiny_models["llama-gqa-untied"], max_model_len=100000)
    assert _llm(tiny_models["llama-gqa-untied"], max_model_len=512).llm_engine.max_model_len == 512


def test_max_model_len_never_exceeds_the_kv_pool(tiny_models: dict[str, Path],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A request longer than the pool could never run: it used to be cut short with
    finish_reason "length" while max_model_len promised more. The length in force is
    lowered to the pool, asked for or not, with a warning saying so."""
    path = tiny_models["llama-gqa-untied"]
    pool = dict(block_size=8, kv_cache_memory_bytes=512 * 8 * 14)  # 112 tokens
    with caplog.at_level("WARNING", logger="pagellm.engine.llm_engine"):
        assert _llm(path, max_model_len=200, **pool).llm_engine.max_model_len == 112
    assert "lowered from 200 (as asked) to 112" in caplog.text
    assert _llm(path, max_model_len=100, **pool).llm_engine.max_model_len == 100
    with caplog.at_level("WARNING", logger="pagellm.engine.llm_engine"):
        llm = _llm(path, **pool)
    assert llm.llm_engine.max_model_len == 112
    assert "lowered from 512 (the model's context length) to 112" in caplog.text
    (out,) = llm.generate({"prompt_token_ids": [5] * 100},
                          SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                          use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len is 112"):
        llm.generate({"prompt_token_ids": [5] * 112}, _greedy(1), use_tqdm=False)
    assert_idle(llm.llm_engine)
    # A pool of one token serves nothing: refused at start, as max_model_len=1 is.
    with pytest.raises(ValueError, match="holds 1 token, too few.*num_gpu_blocks_override"):
        _llm(path, block_size=1, num_gpu_blocks_override=1)
    assert _llm(path, block_size=1, num_gpu_blocks_override=2).llm_engine.max_model_len == 2


@pytest.mark.parametrize("name", ["llama-gqa-untied", "llama-mha-tied", "qwen3-qk-norm"])
def test_long_shared_prefix_takes_cascade_and_matches(name: str, tiny_models: dict[str, Path],
                                                      hf_models: dict[str, Any],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Many requests on one long cached prefix: attention reads the prefix once for all of
    them (the cascade path, in prefill and decode) and the tokens still equal the
    reference. The cascade is a CPU path, so this runs on the CPU wherever it is."""
    from pagellm.model.attention import TorchBatchedBackend

    calls: list[int] = []
    original = TorchBatchedBackend._attend_cascade

    def counting(self: TorchBatchedBackend, *args: Any) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return original(self, *args)

    monkeypatch.setattr(TorchBatchedBackend, "_attend_cascade", counting)
    llm = _llm(tiny_models[name], block_size=8, device="cpu")
    prompts = _prompts(17, 100, [3, 8, 13, 21, 5])
    outputs = _run(llm, prompts, 12)
    assert calls, "the shared prefix was never attended through the cascade"
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.num_cached_tokens >= 96 or out is outputs[0]
        assert_greedy_equal(hf_models[name], prompt, out.outputs[0].token_ids,
                            hf_greedy(hf_models[name], prompt, 12), f"cascade {name}")


def test_engine_hashes_blocks_with_sha256_by_default(tiny_models: dict[str, Path]) -> None:
    """A 64-bit hash can be made to collide on purpose, and with several tenants that
    serves one tenant's KV to another: every entry point defaults to SHA-256."""
    import argparse
    import hashlib

    from pagellm.engine.config import EngineConfig
    from pagellm.entrypoints.engine_args import add_engine_args

    assert EngineConfig().prefix_caching_hash_algo == "sha256"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).prefix_caching_hash_algo == "sha256"
    engine = _llm(tiny_models["llama-gqa-untied"]).llm_engine
    assert engine.hasher.algorithm == "sha256"
    root = engine.hasher.root()
    block = list(range(engine.hasher.block_size))
    expected = hashlib.sha256(root + b"".join(t.to_bytes(4, "little") for t in block))
    assert engine.hasher.hash_block(root, block) == expected.digest()


def _reference_prompt_logprobs(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _assert_prompt_logprobs(out: Any, prompt: list[int], ref: torch.Tensor, top: int) -> None:
    scores = out.prompt_logprobs
    assert scores is not None and len(scores) == len(prompt) and scores[0] is None
    for position, score in enumerate(scores[1:]):
        expected = ref[position]
        assert score.token_id == prompt[position + 1]
        assert score.logprob == pytest.approx(float(expected[prompt[position + 1]]), abs=1e-4)
        assert score.rank == int((expected > expected[prompt[position + 1]]).sum()) + 1
        assert [t for t, _ in score.top_logprobs] == expected.topk(top).indices.tolist()


@pytest.mark.parametrize("budget", [512, 16])
def test_prompt_logprobs_match_the_reference(budget: int, tiny_models: dict[str, Path],
                                             hf_models: dict[str, Any]) -> None:
    """Every prompt position scored as transformers scores it, whether the prompt runs in
    one chunk or many, and even when the prompt is already cached: such a request takes
    no cache hit (a cached position has no logits). Forked samples share the scores."""
    name = "llama-gqa-untied"
    llm = _llm(tiny_models[name], max_num_batched_tokens=budget, block_size=8)
    prompt = _prompts(21, 140, [5])[0]  # 145 tokens: scored 64 rows at a time
    ref = _reference_prompt_logprobs(hf_models[name], prompt)
    _run(llm, [prompt], 2)  # now cached
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=3,
                            n=2)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    _assert_prompt_logprobs(out, prompt, ref, 3)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1
    assert llm.generate({"prompt_token_ids": prompt}, _greedy(2),
                        use_tqdm=False)[0].num_cached_tokens == 144
    assert_idle(llm.llm_engine)


def test_prompt_logprobs_survive_preemption(tiny_models: dict[str, Path],
                                            hf_models: dict[str, Any]) -> None:
    """A pool too small for all requests: preempted ones compute their prompt again, and
    each prompt position is still reported once, as the reference scores it."""
    name = "llama-gqa-untied"
    llm = _llm(tiny_models[name], block_size=8, kv_cache_memory_bytes=512 * 8 * 14,
               max_num_batched_tokens=24)
    prompts = _prompts(11, 16, [4, 6, 8, 10])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        _assert_prompt_logprobs(out, prompt, _reference_prompt_logprobs(hf_models[name], prompt),
                                1)
    assert_idle(llm.llm_engine)
