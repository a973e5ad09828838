"""Beam search (`LLM.beam_search`, `BeamSearchParams`): the sequences and scores of
transformers' `generate(num_beams=k)`, with prefix caching on or off, through block
boundaries, preemption and batching; each step's beams served from the prefix cache; an
abort or an error leaves no block held."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pagellm import LLM, BeamSearchOutput, BeamSearchParams, SamplingParams
from pagellm.engine.beam_search import BeamSearch, length_score
from tests.engine.conftest import assert_idle, make_tiny_model

EOS = 1  # the tiny models' EOS


def _hf_beams(model: Any, prompt: list[int], params: BeamSearchParams,
              eos: int | list[int]) -> list[tuple[list[int], float]]:
    """transformers' beam search: each sequence's generated tokens (through its EOS) and
    its score. Our ignore_eos is transformers without an EOS."""
    from transformers import GenerationConfig

    stop = None if params.ignore_eos else eos
    config = GenerationConfig(
        num_beams=params.beam_width, num_return_sequences=params.beam_width,
        max_new_tokens=params.max_tokens, do_sample=False, early_stopping=False,
        length_penalty=params.length_penalty, eos_token_id=stop, pad_token_id=0)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = stop  # else generate falls back to the model's
    try:
        with torch.no_grad():
            result = model.generate(torch.tensor([prompt]), generation_config=config,
                                    output_scores=True, return_dict_in_generate=True)
    finally:
        model.generation_config.eos_token_id = saved
    beams = []
    for sequence, score in zip(result.sequences, result.sequences_scores, strict=True):
        tokens = sequence.tolist()[len(prompt):]
        ends = [i for i, t in enumerate(tokens)
                if stop is not None and t in (stop if isinstance(stop, list) else [stop])]
        if ends:  # shorter sequences are padded after their EOS
            tokens = tokens[:ends[0] + 1]
        beams.append((tokens, float(score)))
    return beams


def _assert_like_reference(output: BeamSearchOutput, prompt: list[int],
                           reference: list[tuple[list[int], float]],
                           params: BeamSearchParams, eos_ids: tuple[int, ...] = (EOS,)
                           ) -> None:
    ours = [(s.tokens[len(prompt):], s.cum_logprob / (len(s.tokens) - len(prompt))
             ** params.length_penalty) for s in output.sequences]
    assert [tokens for tokens, _ in ours] == [tokens for tokens, _ in reference]
    for (_, score), (_, expected) in zip(ours, reference, strict=True):
        assert score == pytest.approx(expected, abs=2e-3, rel=1e-4)
    for sequence in output.sequences:
        assert sequence.tokens[:len(prompt)] == prompt
        generated = sequence.tokens[len(prompt):]
        assert len(sequence.logprobs) == len(generated)
        assert [lp.token_id for lp in sequence.logprobs] == generated
        assert sequence.cum_logprob == pytest.approx(sum(lp.logprob for lp in
                                                         sequence.logprobs))
        ended_on_eos = generated[-1] in eos_ids and not params.ignore_eos
        assert sequence.finish_reason == ("stop" if ended_on_eos else "length")
        if not ended_on_eos:
            assert len(generated) == params.max_tokens


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 384) for _ in range(n)] for n in lengths]


SETTINGS = [BeamSearchParams(beam_width=2, max_tokens=12),
            BeamSearchParams(beam_width=4, max_tokens=10, length_penalty=0.0),
            BeamSearchParams(beam_width=3, max_tokens=16, length_penalty=-0.5),
            BeamSearchParams(beam_width=5, max_tokens=8, length_penalty=2.0,
                             ignore_eos=True)]


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama that often says EOS, so that beams finish early, as real ones do."""
    path = make_tiny_model(tmp_path_factory.mktemp("beam") / "llama")
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"][EOS] *= 6.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def eos_reference(eos_model: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(eos_model, dtype=torch.float32).eval()


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "nocache"])
def test_tiny_model_matches_transformers(eos_model: Path, eos_reference: Any,
                                         caching: bool) -> None:
    llm = LLM(str(eos_model), skip_tokenizer_init=True, block_size=4,
              kv_cache_memory_bytes=4 << 20, enable_prefix_caching=caching)
    prompts = _prompts(1, [1, 5, 23, 40])
    finish_reasons = set()
    for params in SETTINGS:
        outputs = llm.beam_search(prompts, params)
        for prompt, output in zip(prompts, outputs, strict=True):
            assert len(output.sequences) == params.beam_width
            _assert_like_reference(output, prompt, _hf_beams(eos_reference, prompt, params,
                                                             EOS), params)
            finish_reasons |= {s.finish_reason for s in output.sequences}
        assert_idle(llm.llm_engine)
    assert finish_reasons == {"stop", "length"}


def test_steps_compute_only_what_the_cache_lacks(tiny: Path) -> None:
    """After the prompt, a step computes at most a block's worth of tokens per beam: the
    rest of every beam's sequence is found in the prefix cache."""
    llm = LLM(str(tiny), skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)
    prompt = _prompts(2, [200])[0]
    params = BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True)
    output = llm.beam_search([prompt], params)[0]
    stats = llm.llm_engine.get_stats()
    computed = stats.prefix_cache_queries - stats.prefix_cache_hits
    steps = len(output.sequences[0].tokens) - len(prompt)
    assert computed <= len(prompt) + (steps - 1) * params.beam_width * 16
    # Without the cache every step computes every beam's whole sequence.
    assert stats.prefix_cache_queries > 10 * computed
    again = llm.llm_engine
    request_id = again.add_request(None, prompt, params)
    outputs = []
    while again.has_unfinished_requests():
        outputs += again.step()
    assert [o.request_id for o in outputs] == [request_id]  # the steps stay inside
    final = outputs[0]
    assert final.num_cached_tokens == 192  # the prompt's full blocks, from the first search
    assert [c.token_ids for c in final.outputs] == [
        s.tokens[len(prompt):] for s in output.sequences]
    assert_idle(again)


def test_a_tight_pool_batching_and_concurrency_limit_change_nothing(eos_model: Path
                                                                     ) -> None:
    prompts = _prompts(3, [30, 31, 47, 9, 60])
    params = BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=0.5)
    roomy = LLM(str(eos_model), skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)
    expected = roomy.beam_search(prompts, params)
    one_at_a_time = roomy.beam_search(prompts, params, concurrency_limit=1)
    # 24 blocks of 4 tokens: the 20 beams of the five searches cannot all hold theirs,
    # so steps wait for room and cached blocks are evicted and computed again.
    tight = LLM(str(eos_model), skip_tokenizer_init=True, block_size=4, max_model_len=96,
                kv_cache_memory_bytes=24 * 4 * 512)
    squeezed = tight.beam_search(prompts, params)
    assert tight.llm_engine.get_stats().num_evictions > 0
    for outputs in (one_at_a_time, squeezed):
        assert [[s.tokens for s in o.sequences] for o in outputs] == [
            [s.tokens for s in o.sequences] for o in expected]
    assert_idle(roomy.llm_engine)
    assert_idle(tight.llm_engine)


def test_abort_and_bad_input_leave_nothing_held(tiny: Path) -> None:
    llm = LLM(str(tiny), skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)
    engine = llm.llm_engine
    params = BeamSearchParams(beam_width=3, max_tokens=50, ignore_eos=True)
    engine.add_request("search", _prompts(4, [20])[0], params)
    assert engine.get_num_unfinished_requests() == 1
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_waiting) == (0, 1)
    for _ in range(4):
        assert engine.step() == []  # beams' steps are not outputs
        # One search, running, though between steps its next requests wait.
        stats = engine.get_stats()
        assert (stats.num_running, stats.num_waiting) == (1, 0)
    assert engine.get_num_unfinished_requests() == 1
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("search", [5, 6], params)
    # The steps' requests are the search's: aborting one by its id changes nothing.
    engine.abort_request([f"search/beam{n}.{i}" for n in range(8) for i in range(3)])
    for _ in range(3):
        assert engine.step() == []
    engine.abort_request("search")
    assert_idle(engine)
    engine.add_request("again", [5, 6, 7], BeamSearchParams(beam_width=2, max_tokens=6))
    engine.abort_request([f"again/beam{n}.{i}" for n in range(8) for i in range(2)])
    outputs = [o for _ in iter(engine.has_unfinished_requests, False) for o in engine.step()]
    assert [(o.request_id, len(o.outputs)) for o in outputs] == [("again", 2)]
    assert_idle(engine)
    # A caller who took a step's id first keeps it; the step's id is extended.
    engine.add_request("s/beam1.0", [5, 6], SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request("s", [5, 6, 7], BeamSearchParams(beam_width=2, max_tokens=4))
    outputs = [o for _ in iter(engine.has_unfinished_requests, False) for o in engine.step()]
    finals = {o.request_id: o for o in outputs if o.finished}
    assert set(finals) == {"s/beam1.0", "s"}
    assert len(finals["s/beam1.0"].outputs[0].token_ids) == 12
    assert len(finals["s"].outputs) == 2
    assert_idle(engine)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([[5] * engine.max_model_len], params)
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search([[5, 6]], {"beam_width": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="logprobs must be at most 6 with beam_width 3"):
        llm.beam_search([[5, 6]], BeamSearchParams(beam_width=3, max_tokens=2, logprobs=7))
    kept = llm.beam_search([[5, 6]], BeamSearchParams(beam_width=3, max_tokens=2,
                                                      logprobs=1))[0]
    assert all(len(lp.top_logprobs) == 1 for s in kept.sequences for lp in s.logprobs)
    with pytest.raises(ValueError, match="for beam_search"):
        llm.generate([[5, 6]], params)
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search([[5, 6]], params, concurrency_limit=0)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.beam_search([[5, 6], []], params)
    assert_idle(engine)


def test_several_eos_tokens_widen_each_step(tmp_path: Path) -> None:
    """With three EOS tokens transformers ranks 4 * beam_width continuations a step, and
    so do we; more than the engine reads (20) is refused, unless EOS is ignored."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "eos3", eos_token_id=[1, 2, 3])
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"][1:4] *= 5.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    prompts = _prompts(5, [3, 18])
    reasons = set()
    for prompt, output in zip(prompts, llm.beam_search(prompts, params), strict=True):
        _assert_like_reference(output, prompt, _hf_beams(reference, prompt, params,
                                                         [1, 2, 3]), params, (1, 2, 3))
        reasons |= {s.tokens[-1] for s in output.sequences if s.finish_reason == "stop"}
    assert len(reasons) > 1  # beams ended on different EOS tokens
    with pytest.raises(ValueError, match="beam_width 6 ranks 24 continuations"):
        llm.beam_search([[5, 6]], BeamSearchParams(beam_width=6, max_tokens=4))
    assert len(llm.beam_search([[5, 6]], BeamSearchParams(
        beam_width=6, max_tokens=4, ignore_eos=True))[0].sequences) == 6
    assert_idle(llm.llm_engine)


def test_extreme_length_penalties_rank_without_failing_the_step(tiny: Path) -> None:
    """A length_penalty whose power leaves the floats' range scores every finished beam
    alike instead of raising inside the step, which would fail every request in it."""
    assert length_score(-3.0, 6, 1000.0) == 0.0 and length_score(-3.0, 6, -1000.0) == -math.inf
    assert length_score(0.0, 6, -1000.0) == 0.0 and length_score(-3.0, 6, 1.0) == -0.5
    llm = LLM(str(tiny), skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)
    engine = llm.llm_engine
    engine.add_request("bystander", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    for penalty in (1000.0, -1000.0):
        engine.add_request(f"beam{penalty}", [5, 6], BeamSearchParams(
            beam_width=2, max_tokens=6, length_penalty=penalty))
    outputs = [o for _ in iter(engine.has_unfinished_requests, False) for o in engine.step()]
    finals = {o.request_id: o for o in outputs if o.finished}
    assert set(finals) == {"bystander", "beam1000.0", "beam-1000.0"}
    assert len(finals["bystander"].outputs[0].token_ids) == 8
    assert all(len(finals[f"beam{p}"].outputs) == 2 for p in (1000.0, -1000.0))
    assert_idle(engine)


def test_the_search_stops_once_no_beam_can_win() -> None:
    """transformers' early stop: with `beam_width` finished, a running beam whose score at
    its current length cannot beat the worst of them ends the search early."""
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=100, length_penalty=0.0),
                        frozenset({EOS}), 100)
    search.advance([[(EOS, -0.1), (7, -0.5), (8, -0.6), (9, -3.0)]])
    assert [b.token_ids for b in search.finished] == [[EOS]]
    assert [b.token_ids for b in search.running] == [[7], [8]]
    assert not search.done
    search.advance([[(EOS, -0.2), (3, -2.0), (4, -2.1), (5, -2.2)],
                    [(EOS, -0.3), (3, -2.5), (4, -2.6), (5, -2.7)]])
    # Best first; the running beams now trail both finished ones at any length.
    assert [(b.token_ids, round(b.score, 3)) for b in search.finished] == [
        ([EOS], -0.1), ([7, EOS], -0.7)]
    assert search.done


def test_candidates_and_params() -> None:
    assert BeamSearchParams(beam_width=4, max_tokens=1).candidates(1) == 8
    assert BeamSearchParams(beam_width=4, max_tokens=1).candidates(2) == 12
    assert BeamSearchParams(beam_width=4, max_tokens=1, ignore_eos=True).candidates(2) == 8
    for bad, message in [({"beam_width": 0}, "beam_width"), ({"beam_width": 11}, "beam_width"),
                         ({"max_tokens": 0}, "max_tokens"),
                         ({"temperature": 0.7}, "temperature must be 0"),
                         ({"length_penalty": float("nan")}, "length_penalty"),
                         ({"logprobs": 21}, "logprobs"),
                         ({"ignore_eos": 1}, "ignore_eos")]:
        with pytest.raises(ValueError, match=message):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})


@pytest.mark.slow
def test_default_model_matches_transformers(default_llm: Any, default_hf_model: Any) -> None:
    """A chat answer, whose beams end on EOS, and a plain text continuation."""
    llm = default_llm
    chat = llm.apply_chat_template([{"role": "user", "content": "Reply with one word: what color is the sky?"}])
    text = llm.tokenizer.encode("The three most visited cities in Europe are")
    eos = llm.llm_engine.model_config.eos_token_ids[0]
    for prompt, params in [(chat, BeamSearchParams(beam_width=3, max_tokens=24)),
                           (text, BeamSearchParams(beam_width=2, max_tokens=16,
                                                   length_penalty=0.0))]:
        output = llm.beam_search([{"prompt_token_ids": prompt}], params)[0]
        reference = _hf_beams(default_hf_model, prompt, params, eos)
        ours = [s.tokens[len(prompt):] for s in output.sequences]
        assert ours == [tokens for tokens, _ in reference]
        for sequence in output.sequences:
            # vLLM's text: the prompt's and the continuation's, special tokens skipped.
            assert sequence.text == llm.tokenizer.decode(sequence.tokens,
                                                         skip_special_tokens=True)
        if prompt is chat:
            assert {s.finish_reason for s in output.sequences} == {"stop"}
    engine = llm.llm_engine
    engine.add_request("answer", chat, BeamSearchParams(beam_width=2, max_tokens=24,
                                                        include_stop_str_in_output=True,
                                                        skip_special_tokens=False))
    final = [o for _ in iter(engine.has_unfinished_requests, False) for o in engine.step()]
    assert len(final) == 1 and final[0].finished and final[0].num_cached_tokens > 0
    assert "stop" in {c.finish_reason for c in final[0].outputs}
    for completion in final[0].outputs:
        assert completion.text == llm.tokenizer.decode(completion.token_ids)
        assert completion.logprobs is not None
        # Each token's text begins where the text before it ends, as in any output.
        assert [lp.text_offset for lp in completion.logprobs] == [
            len(llm.tokenizer.decode(completion.token_ids[:i]))
            for i in range(len(completion.token_ids))]
        assert (completion.token_ids[-1] == eos) == (completion.finish_reason == "stop")
        assert completion.text.endswith("<|im_end|>") == (completion.finish_reason == "stop")
    assert_idle(engine)
