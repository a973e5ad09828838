"""vLLM's Python API where its scripts reach past `LLM.generate`: its import paths, the
`EngineArgs` round trip and `from_engine_args`, `output_kind` (DELTA / FINAL_ONLY) on
the step loop and on `AsyncLLMEngine.generate`, and the arguments its wrappers pass
through. Each is checked against what the same request gives cumulatively."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from tqdm import tqdm

from pagellm import (
    LLM,
    AsyncEngineArgs,
    AsyncLLMEngine,
    EngineArgs,
    LLMEngine,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from pagellm.worker.kv_cache import device_memory_bytes
from tests.engine.conftest import assert_idle

SMALL = ["--kv-cache-memory-bytes", "32MiB", "--max-model-len", "512"]
PROMPT = "The three primary colours are"


def run_all(engine: LLMEngine) -> list[Any]:
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    engine_args = EngineArgs.from_cli_args(parser.parse_args(SMALL))
    assert isinstance(engine_args, EngineArgs) and engine_args.max_model_len == 512
    return LLMEngine.from_engine_args(engine_args)


def test_vllm_import_paths() -> None:
    from pagellm.outputs import CompletionOutput, RequestOutput
    from pagellm.sampling_params import (
        BeamSearchParams,
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )

    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert BeamSearchParams(beam_width=2, max_tokens=4).beam_width == 2
    assert StructuredOutputsParams(regex="a+").regex == "a+"
    assert CompletionOutput(0, "", [], "stop").finished()  # a method, as in vLLM
    assert RequestOutput.__name__ == "RequestOutput"
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")  # type: ignore[arg-type]


def test_delta_outputs_add_up_to_the_cumulative_ones(engine: LLMEngine) -> None:
    """n=2 sampled with a seed: each sample's pieces (text, token ids, logprobs) join
    into what the cumulative request gives, and the prompt's logprobs come once."""
    assert engine.get_tokenizer() is engine.tokenizer
    params: dict[str, Any] = dict(n=2, temperature=1.0, seed=3, logprobs=1, prompt_logprobs=1,
                                  max_tokens=10, stop=["."])  # one stops after 5 tokens
    engine.add_request("whole", PROMPT, SamplingParams(**params))
    (whole,) = [o for o in run_all(engine) if o.finished]
    engine.add_request("delta", PROMPT, SamplingParams(**params,
                                                       output_kind=RequestOutputKind.DELTA))
    pieces = run_all(engine)
    assert len(pieces) > 1 and pieces[-1].finished and not pieces[0].finished
    assert len(pieces[-1].outputs) == 1  # the sample that stopped early is not resent
    assert pieces[0].prompt_logprobs == whole.prompt_logprobs
    assert all(piece.prompt_logprobs is None for piece in pieces[1:])
    for completion in whole.outputs:
        parts = [part for piece in pieces for part in piece.outputs
                 if part.index == completion.index]
        assert "".join(part.text for part in parts) == completion.text
        assert [t for part in parts for t in part.token_ids] == completion.token_ids
        assert [lp for part in parts for lp in part.logprobs or []] == completion.logprobs
        # Sent finished once, as in vLLM, and not again with later pieces.
        assert [part.finish_reason for part in parts if part.finished()] == [
            completion.finish_reason]
    late = SamplingParams(max_tokens=2)
    late.output_kind = "delta"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        engine.add_request("late", PROMPT, late)
    engine.add_request("final", PROMPT, SamplingParams(
        **params, output_kind=RequestOutputKind.FINAL_ONLY))
    (final,) = run_all(engine)
    assert final.finished and [c.text for c in final.outputs] == [c.text for c in whole.outputs]
    assert_idle(engine)


@pytest.mark.parametrize("field, value, message", [
    ("n", 0, "n must be in"), ("max_tokens", 0, "max_tokens must be"),
    ("logprobs", 99, "logprobs must be in"), ("temperature", -1.0, "temperature must be in"),
    ("top_p", 2.0, "top_p must be in"), ("stop", 3, "stop must be"),
])
def test_fields_set_after_construction_are_checked_when_the_request_is_added(
        engine: LLMEngine, field: str, value: Any, message: str) -> None:
    """The constructor's checks again at add_request: n=0 used to fail on a bare
    assertion, max_tokens=0 to give a token, logprobs=99 to give 99 alternatives."""
    params = SamplingParams(temperature=0, max_tokens=3)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=message):
        engine.add_request("mutated", PROMPT, params)
    assert not engine.has_unfinished_requests()
    assert_idle(engine)


def test_a_queued_request_keeps_its_params_when_the_caller_changes_them(
        engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("queued", PROMPT, params)
    params.max_tokens = 12
    (done,) = [o for o in run_all(engine) if o.finished]
    assert len(done.outputs[0].token_ids) == 3 and done.outputs[0].finish_reason == "length"
    assert params.max_tokens == 12  # the caller's object is the caller's
    assert_idle(engine)


def test_gpu_memory_utilization_leaves_the_pool_what_the_model_does_not_use(
        tiny: Path) -> None:
    """vLLM's most common argument, on the CPU as vLLM's CPU build reads it: the
    engine's share of the machine's memory; the pool is what the loaded model leaves."""
    _free, total = device_memory_bytes(torch.device("cpu"))
    used = psutil.Process().memory_info().rss
    share = (used + (64 << 20)) / total  # about 64 MiB more than in use now
    llm = LLM(str(tiny), skip_tokenizer_init=True, gpu_memory_utilization=share)
    pool = sum(t.numel() * t.element_size() for t in llm.llm_engine.kv_cache.tensors)
    assert 0 < pool <= 64 << 20
    greedy = SamplingParams(max_tokens=3, temperature=0)
    assert len(llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy)[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="no room for a KV block"):
        LLM(str(tiny), skip_tokenizer_init=True, gpu_memory_utilization=used / total / 2)


def test_llm_takes_vllms_arguments() -> None:
    """from_engine_args, options that ask for what PageLLM does anyway, one priority for
    all prompts, lora_request=None, a tqdm class, and whole outputs from generate
    whatever the output_kind."""
    llm = LLM.from_engine_args(EngineArgs(kv_cache_memory_bytes=32 << 20, max_model_len=512,
                                          tensor_parallel_size=1))
    greedy = SamplingParams(max_tokens=6, temperature=0)
    (expected,) = llm.generate(PROMPT, greedy, use_tqdm=False)
    bars: list[Any] = []

    class Bar(tqdm):  # type: ignore[type-arg]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            bars.append(self)

    outputs = llm.generate([PROMPT, PROMPT], greedy.clone(output_kind=RequestOutputKind.DELTA),
                           use_tqdm=Bar, priority=0, lora_request=None)
    assert [o.outputs[0].text for o in outputs] == [expected.outputs[0].text] * 2
    assert len(bars) == 1 and bars[0].n == 2
    chat = llm.chat([{"role": "user", "content": "Hi"}], greedy, use_tqdm=False, priority=0)
    assert chat[0].outputs[0].text
    with pytest.raises(ValueError, match="lora_request must be None"):
        llm.generate(PROMPT, greedy, lora_request=object())  # type: ignore[arg-type]
    # What code written for vLLM reads past the text: lm-eval's harness takes the context
    # from model_config.max_model_len; generic loggers read the adapter and encoder fields.
    assert llm.llm_engine.model_config.max_model_len == 512 == llm.model_config.max_model_len
    assert llm.model_config.get_vocab_size() == llm.model_config.vocab_size
    assert (expected.lora_request, expected.encoder_prompt, expected.encoder_prompt_token_ids,
            expected.kv_transfer_params, expected.outputs[0].lora_request) == (None,) * 5
    assert llm.get_tokenizer().truncation_side == "left"  # vLLM's, for a generation model
    tagged = SamplingParams(max_tokens=2, extra_args={"tag": 1})
    assert tagged.clone().extra_args == {"tag": 1}
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args=[1])  # type: ignore[arg-type]
    assert_idle(llm.llm_engine)
    # vLLM's basic/generate.py: LLM(**vars(args)) of its engine flags, with the flags
    # that ask for what PageLLM does anyway.
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    neutral = LLM(**vars(parser.parse_args(
        [*SMALL, "--tensor-parallel-size", "1", "--trust-remote-code"])))
    assert neutral.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].text == \
        expected.outputs[0].text
    for construct in (LLM, EngineArgs):
        with pytest.raises(TypeError, match="tensor_parallel_size is vLLM's"):
            construct(tensor_parallel_size=2)


def test_async_generate_streams_deltas_and_aborts_when_left() -> None:
    """vLLM's `AsyncLLM.generate` loop: DELTA pieces join into the cumulative answer,
    breaking out of the loop frees the request at once, and an abort by id ends a
    reader's loop with a last output whose finish_reason is "abort"."""
    engine = AsyncLLMEngine.from_engine_args(
        AsyncEngineArgs(kv_cache_memory_bytes=32 << 20, max_model_len=512))
    greedy = SamplingParams(max_tokens=12, temperature=0)

    async def scenario() -> tuple[str, list[str]]:
        whole = ""
        async for output in engine.generate(PROMPT, greedy, "whole"):
            whole = output.outputs[0].text
        pieces = [output.outputs[0].text async for output in engine.generate(
            PROMPT, greedy.clone(output_kind=RequestOutputKind.DELTA), "delta")]
        async for output in engine.generate(PROMPT, greedy.clone(max_tokens=400,
                                                                 ignore_eos=True), "left"):
            if len(output.outputs[0].token_ids) >= 2:
                break
        # No id: the engine picks one, and the stream is found under it.
        unnamed = [o async for o in engine.generate(PROMPT, greedy, None)]  # type: ignore[arg-type]
        assert unnamed[-1].finished and unnamed[-1].outputs[0].text == whole
        # Fields set after construction are checked (and a format given as a dict
        # converted) before the async path reads them, as LLMEngine.add_request does.
        late = greedy.clone(max_tokens=4)
        late.structured_outputs = {"choice": ["yes", "no"]}  # type: ignore[assignment]
        formatted = [o async for o in engine.generate(PROMPT, late, "late")]
        assert formatted[-1].outputs[0].text in ("yes", "no")
        late.n = 0
        with pytest.raises(ValueError, match="n must be in"):
            await engine.add_request("bad", PROMPT, late)
        stream = await engine.add_request("awaited", PROMPT, greedy.clone(max_tokens=400))
        await engine.abort("awaited")  # vLLM's abort is a coroutine
        # The id taken again at once: the first reader's end does not abort the second.
        again = await engine.add_request("awaited", PROMPT, greedy)
        assert [o async for o in stream] == [] or stream.finished
        assert [o async for o in again][-1].outputs[0].text == whole
        pair = [await engine.add_request(name, PROMPT, greedy.clone(max_tokens=400, n=n,
                                                                     seed=n))
                for name, n in (("a", 1), ("b", 2))]
        engine.abort(["a", "b"])  # several ids, as vLLM takes them
        for each in pair:  # each reader gets the last output, finished by the abort
            last = [o async for o in each][-1]
            assert last.finished and {c.finish_reason for c in last.outputs} == {"abort"}
        # A DELTA reader, aborted from a task as vLLM's coroutine allows: the last piece
        # says why it ended (with any token a step added before the abort).
        deltas = []
        async for output in engine.generate(PROMPT, greedy.clone(
                max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA), "c"):
            deltas.append(output)
            if len(deltas) == 3:
                await asyncio.create_task(engine.abort("c"))
        assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "abort"
        assert len(deltas[-1].outputs[0].token_ids) < 400
        with pytest.raises(TypeError, match="abort takes a request id"):
            engine.abort(None)  # type: ignore[arg-type]
        # vLLM 0.32's plain method and older vLLM's coroutine, both.
        assert (await engine.get_tokenizer()) is engine.get_tokenizer() is engine.tokenizer
        assert engine.get_tokenizer().encode("hello world")
        await engine.check_health()
        assert not engine.errored
        return whole, pieces

    try:
        whole, pieces = asyncio.run(scenario())
        assert len(pieces) > 1 and "".join(pieces) == whole
        deadline = 100
        while engine.engine.has_unfinished_requests() and deadline:
            asyncio.run(asyncio.sleep(0.05))
            deadline -= 1
        assert not engine.engine.has_unfinished_requests()
    finally:
        engine.shutdown()
    assert_idle(engine.engine)


def test_async_requests_may_share_an_id_as_in_vllm(tiny: Any) -> None:
    """vLLM 0.32 runs a request whose id is already running (each answered under that
    id; an abort by it ends both); pooling calls are refused by name."""
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        model=str(tiny), skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20))
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    async def last(params: SamplingParams) -> RequestOutput:
        outputs = [output async for output in engine.generate(prompt, params, "same")]
        return outputs[-1]

    async def scenario() -> None:
        first, second = await asyncio.gather(last(greedy), last(greedy))
        assert first.request_id == second.request_id == "same"
        assert first.outputs[0].token_ids == second.outputs[0].token_ids
        long = greedy.clone(max_tokens=400)
        tasks = [asyncio.create_task(last(long)) for _ in range(2)]
        for _ in range(1000):
            if engine.stats().num_running == 2:
                break
            await asyncio.sleep(0.01)
        await engine.abort("same")
        for ended in await asyncio.gather(*tasks):
            assert ended.request_id == "same" and ended.outputs[0].finish_reason == "abort"
        # Leaving one twin's stream ends that one only.
        left = await engine.add_request("twin", prompt, long)
        kept = await engine.add_request("twin", prompt, greedy)
        left.abort()
        outputs = [output async for output in kept]
        assert outputs[-1].request_id == "twin" and outputs[-1].outputs[0].finish_reason
        assert outputs[-1].outputs[0].finish_reason != "abort"
        # n > 1 names its samples "id#k": an id a caller's request holds that way too.
        await engine.add_request("n#1", prompt, long)
        answers = [output async for output in engine.generate(
            prompt, greedy.clone(n=2), "n")]
        assert answers[-1].request_id == "n" and len(answers[-1].outputs) == 2
        await engine.abort("n#1")

    try:
        asyncio.run(scenario())
        with pytest.raises(ValueError, match="there is no tokenizer: the engine was built "
                                             "with skip_tokenizer_init"):
            engine.get_tokenizer()
        for call in (engine.encode, engine.embed, LLM.score):
            with pytest.raises(ValueError, match="is vLLM's pooling API: models are run to "
                                                 "generate text only"):
                call(prompt)  # type: ignore[operator]
    finally:
        engine.shutdown()
    assert not engine.engine.has_unfinished_requests()


def test_skip_reading_prefix_cache_computes_the_prompt_whole(engine: LLMEngine) -> None:
    """vLLM's `skip_reading_prefix_cache`: the prompt is computed though it is cached
    (the same greedy tokens), it is left out of the hit rate, and its blocks are still
    cached for the next request; prompt logprobs imply it and cannot turn it off."""
    greedy = SamplingParams(max_tokens=4, temperature=0)
    engine.add_request("warm", PROMPT * 4, greedy)
    (warm,) = [o for o in run_all(engine) if o.finished]
    before = engine.get_stats()
    engine.add_request("cold", PROMPT * 4, greedy.clone(skip_reading_prefix_cache=True))
    (cold,) = [o for o in run_all(engine) if o.finished]
    after = engine.get_stats()
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == warm.outputs[0].token_ids
    assert after.prefix_cache_queries == before.prefix_cache_queries
    engine.add_request("again", PROMPT * 4, greedy)
    (again,) = [o for o in run_all(engine) if o.finished]
    assert again.num_cached_tokens > 0
    with pytest.raises(ValueError, match="skip_reading_prefix_cache cannot be False"):
        SamplingParams(prompt_logprobs=0, skip_reading_prefix_cache=False)
    # Prompt logprobs set by clone() or after construction still compute the prompt
    # whole (every position scored), and dropping them reads the cache again.
    scored = greedy.clone(prompt_logprobs=0)
    late = greedy.clone()
    late.prompt_logprobs = 0
    for request_id, params in (("scored", scored), ("late", late)):
        engine.add_request(request_id, PROMPT * 4, params)
        (output,) = [o for o in run_all(engine) if o.finished]
        assert output.num_cached_tokens == 0 and len(output.prompt_logprobs) == len(
            output.prompt_token_ids)
    engine.add_request("unscored", PROMPT * 4, scored.clone(prompt_logprobs=None))
    assert [o for o in run_all(engine) if o.finished][0].num_cached_tokens > 0
    assert_idle(engine)


def test_reset_prefix_cache_can_preempt_the_running_requests(engine: LLMEngine) -> None:
    """vLLM's reset_prefix_cache(reset_running_requests=True): refused while requests
    hold blocks, done once they are preempted; they recompute and finish with the
    tokens they would have given (n=2 samples forked from one prompt included)."""
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seeded = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    expected = {}
    for request_id, params in (("g", greedy), ("s", seeded)):
        engine.add_request(request_id, PROMPT, params)
        expected.update({o.request_id: [c.token_ids for c in o.outputs]
                         for o in run_all(engine) if o.finished})
    assert engine.reset_prefix_cache()
    engine.add_request("g", PROMPT, greedy)
    engine.add_request("s", PROMPT, seeded)
    for _ in range(4):
        engine.step()
    assert not engine.reset_prefix_cache()
    assert engine.reset_prefix_cache(reset_running_requests=True)
    assert engine.kv_manager.stats().blocks_cached == 0
    finished = {o.request_id: [c.token_ids for c in o.outputs]
                for o in run_all(engine) if o.finished}
    assert finished == expected
    assert_idle(engine)


def test_get_metrics_snapshots_the_engine_and_the_requests_run() -> None:
    """vLLM's metrics example: LLM(disable_log_stats=False).get_metrics() gives Counter,
    Gauge and Histogram records under vLLM's names (and PageLLM's; a counter's without
    the `_total` of its /metrics samples, as vLLM's records come from prometheus_client),
    and they count what generate ran, each completion of an n=2 request apart."""
    from pagellm.engine.metrics import Counter, Gauge, Histogram

    llm = LLM(kv_cache_memory_bytes=32 << 20, max_model_len=512, disable_log_stats=False)
    prefix = "A long shared beginning about colours and paint and light. " * 4
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    llm.generate([prefix + "Red", prefix + "Blue"], [greedy, greedy.clone(n=2, seed=1)],
                 use_tqdm=False)
    metrics = {(m.name, tuple(sorted(m.labels.items()))): m for m in llm.get_metrics()}
    model = ("model_name", "SmolLM2-135M-Instruct")

    def value(name: str, **labels: str) -> Any:
        engine = {"engine": "0"} if name.startswith("vllm:") else {}  # vLLM's label too
        return metrics[(name, tuple(sorted({**dict([model]), **engine, **labels}.items())))]

    assert value("pagellm_request_finished", finished_reason="length") == Counter(
        "pagellm_request_finished", {"model_name": model[1], "finished_reason": "length"}, 3)
    assert value("vllm:request_success", finished_reason="length") == Counter(
        "vllm:request_success",
        {"model_name": model[1], "finished_reason": "length", "engine": "0"}, 3)
    for finished in ("pagellm_request_finished", "vllm:request_success"):
        assert value(finished, finished_reason="abort").value == 0
    assert value("vllm:generation_tokens").value == 15
    assert value("vllm:prefix_cache_hits").value > 0
    assert value("vllm:prefix_cache_queries").value >= \
        value("vllm:prefix_cache_hits").value
    running = value("vllm:num_requests_running")
    assert isinstance(running, Gauge) and running.value == 0
    ttft = value("vllm:time_to_first_token_seconds")
    assert isinstance(ttft, Histogram) and ttft.count == 3 and ttft.buckets["+Inf"] == 3
    assert value("vllm:inter_token_latency_seconds").count == 3 * 4
    assert value("vllm:e2e_request_latency_seconds").count == 3
    assert value("pagellm_kv_cache_blocks").value > 0
    assert_idle(llm.llm_engine)


def test_threads_sharing_one_llm_take_turns(default_llm: LLM) -> None:
    """A threaded app's calls on one `LLM` run one at a time and each gets its own
    answers; stepping the engine from two threads at once left a request unfinished
    forever while both threads spun."""
    import threading

    greedy = SamplingParams(max_tokens=8, temperature=0)
    prompts = [f"Write a sentence about the number {i}." for i in range(4)]
    expected = [o.outputs[0].text for o in default_llm.generate(prompts, greedy,
                                                                use_tqdm=False)]
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        if i % 2:
            answers[i] = default_llm.generate(prompts[i], greedy, use_tqdm=False)[0].outputs[0].text
        else:
            answers[i] = default_llm.chat([{"role": "user", "content": prompts[i]}], greedy,
                                          use_tqdm=False)[0].outputs[0].text
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a thread never returned"
    for i in range(1, 4, 2):
        assert answers[i] == expected[i]
    chat_expected = default_llm.chat([[{"role": "user", "content": prompts[i]}]
                                      for i in range(0, 4, 2)], greedy, use_tqdm=False)
    assert [answers[0], answers[2]] == [o.outputs[0].text for o in chat_expected]
    assert_idle(default_llm.llm_engine)


def test_outputs_with_logprobs_pickle_and_do_not_keep_the_engine() -> None:
    """Ray and multiprocessing queues pickle outputs: with logprobs that recursed into
    the whole engine (each entry held the engine's decoder), and a kept output kept the
    engine's memory alive after `del llm`."""
    import copy
    import gc
    import pickle
    import weakref

    llm = LLM(kv_cache_memory_bytes=32 << 20, max_model_len=512)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3, prompt_logprobs=2)
    (output,) = llm.generate(PROMPT, params, use_tqdm=False)
    for again in (pickle.loads(pickle.dumps(output)), copy.deepcopy(output)):
        assert again.outputs[0].token_ids == output.outputs[0].token_ids
        assert again.outputs[0].logprobs == output.outputs[0].logprobs
        assert [dict(p) for p in again.outputs[0].logprobs] == [
            dict(p) for p in output.outputs[0].logprobs]  # texts and all
        assert [dict(p) for p in again.prompt_logprobs[1:]] == [
            dict(p) for p in output.prompt_logprobs[1:]]
    engine = weakref.ref(llm.llm_engine)
    del llm
    gc.collect()
    assert engine() is None
    assert output.outputs[0].logprobs[0][output.outputs[0].token_ids[0]].decoded_token


def test_a_second_ctrl_c_during_cleanup_leaves_nothing_for_the_next_call(
        default_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C pressed twice in a notebook: the second landed while `generate` aborted the
    requests the first one cut short, some kept running, and the next call silently ran
    them to their 500 tokens first (97 s for a 0.5 s call)."""
    engine = default_llm.llm_engine
    steps, aborts = engine.step, engine.abort_request
    calls = {"steps": 0, "aborts": 0}

    def step() -> Any:
        calls["steps"] += 1
        if calls["steps"] == 3:
            raise KeyboardInterrupt  # the first Ctrl-C, mid-run
        return steps()

    def abort(request_ids: Any) -> Any:
        calls["aborts"] += 1
        if calls["aborts"] == 2:
            raise KeyboardInterrupt  # the second, in the cleanup's abort
        return aborts(request_ids)

    monkeypatch.setattr(engine, "step", step)
    monkeypatch.setattr(engine, "abort_request", abort)
    long = SamplingParams(max_tokens=500, ignore_eos=True, temperature=0)
    with pytest.raises(KeyboardInterrupt):
        default_llm.generate([f"Story {i} about a dragon" for i in range(6)], long,
                             use_tqdm=False)
    assert engine.get_num_unfinished_requests() == 6
    monkeypatch.undo()
    short = SamplingParams(max_tokens=4, temperature=0)
    generated = engine.get_stats().generation_tokens
    expected = default_llm.generate("Hi", short, use_tqdm=False)[0].outputs[0].token_ids
    assert engine.get_num_unfinished_requests() == 0
    # The six were aborted, not run on to their 500 tokens inside this call.
    assert engine.get_stats().generation_tokens - generated < 50
    assert default_llm.generate("Hi", short, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert_idle(engine)


def test_an_outputs_repr_leaves_out_the_per_token_times() -> None:
    """A notebook shows an output's whole repr: one timestamp per token made a 2,000-token
    answer's 34 KB longer. The times stay readable as an attribute."""
    from pagellm.engine.outputs import RequestMetrics

    metrics = RequestMetrics(arrival_time=1.0, first_token_time=2.0,
                             token_times=[2.0 + i / 1000 for i in range(2000)])
    assert "token_times" not in repr(metrics) and "first_token_time=2.0" in repr(metrics)
    assert len(metrics.token_times) == 2000


def test_the_engine_keeps_its_random_stream_to_itself(tiny: Any) -> None:
    """Building an `LLM` reset the user's torch random stream (torch.manual_seed), and
    the user's torch draws moved the engine's unseeded sampling. Each engine now draws
    from its own generator, seeded with `seed`."""
    import torch

    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    llm = LLM(str(tiny), skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)
    assert torch.equal(torch.rand(4), expected)
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompts: Any = [{"prompt_token_ids": [5, 6, 7]}] * 4
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled, use_tqdm=False)]
    torch.rand(1000)  # the user's own draws between the engines' calls
    again = LLM(str(tiny), skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)
    assert [o.outputs[0].token_ids for o in again.generate(prompts, sampled,
                                                           use_tqdm=False)] == first
    assert len({tuple(tokens) for tokens in first}) > 1  # they do sample
