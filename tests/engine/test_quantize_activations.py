"""`quantize_activations=True`: the default model's Q4_1 matmuls with int8 inputs. Caching
stays exact (the int8 kernel's rows and the prefill kernel's queries never depend on
their batch), also over a bfloat16 pool; outputs stay close to float32's; the option is
refused where it cannot run, with the reason."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.engine.config import EngineConfig
from pagellm.entrypoints.cli import build_parser
from pagellm.entrypoints.engine_args import EngineArgs
from tests.engine.conftest import assert_idle, make_tiny_model

WORDS = ("the a city river museum train food bread old new walk market square bridge tower "
         "art night morning coffee street").split()


def _chats(n: int) -> list[list[dict[str, str]]]:
    rng = random.Random(0)
    system = "You are a helpful travel assistant. " + " ".join(rng.choice(WORDS)
                                                              for _ in range(150))
    return [[{"role": "system", "content": system},
             {"role": "user", "content": f"Tell me about the {rng.choice(WORDS)} and the "
                                         f"{rng.choice(WORDS)}, number {i}."}]
            for i in range(n)]


def _run(llm: LLM, chats: list[list[dict[str, str]]]) -> list[list[int]]:
    """Two turns: the second sends each first answer back (caching serves its tokens,
    computed in decode steps; without caching they are computed again in a prompt)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first = llm.chat(chats, params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    again = [chat + [{"role": "assistant", "content": tokenizer.decode(out.outputs[0].token_ids)},
                     {"role": "user", "content": "And what else?"}]
             for chat, out in zip(chats, first, strict=True)]
    second = llm.chat(again, params, use_tqdm=False)
    assert_idle(llm.llm_engine)
    return [list(o.outputs[0].token_ids) for o in (*first, *second)]


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16"])
def test_caching_and_chunking_never_change_an_output(kv_cache_dtype: str) -> None:
    """Greedy tokens identical with caching off, on (cold, then warm from its own cache)
    and on with 64-token chunks, over two turns of 12 chats sharing a system prompt: on
    this model int8 rounding parts runs at any difference in float32, so this fails for
    any attention path whose bits depend on the step (the decode kernel, a cascade)."""
    chats = _chats(12)
    runs = {}
    for caching, budget in ((False, 512), (True, 512), (True, 64)):
        llm = LLM(quantize_activations=True, enable_prefix_caching=caching,
                  kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=budget,
                  kv_cache_memory_bytes=64 << 20)
        runs[(caching, budget)] = _run(llm, chats)
        if caching:
            assert _run(llm, chats) == runs[(caching, budget)]  # warm
            assert llm.llm_engine.get_stats().prefix_cache_hits > 0
    assert runs[(True, 512)] == runs[(False, 512)] == runs[(True, 64)]


@pytest.mark.slow
def test_a_bfloat16_pool_changes_nothing_where_attention_rounds_to_it() -> None:
    """With bfloat16 products (AVX-512 BF16), attention rounds keys and values to
    bfloat16 whatever the pool holds, so kv_cache_dtype="bfloat16" gives the very tokens
    and logprobs of the float32 pool in half the memory."""
    chats = _chats(6)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, prompt_logprobs=1)
    results = []
    for kv_cache_dtype in ("float32", "bfloat16"):
        llm = LLM(quantize_activations=True, kv_cache_dtype=kv_cache_dtype,
                  kv_cache_memory_bytes=32 << 20)
        if not torch.ops.pagellm.bf16_products_available():  # loaded with the model
            pytest.skip("this build of the kernels has no bfloat16 products (AVX-512 BF16)")
        outs = llm.chat(chats, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs)
                        for o in outs])
        assert_idle(llm.llm_engine)
    assert results[0] == results[1]


@pytest.mark.slow
def test_an_auto_pool_is_bfloat16_exactly_where_attention_rounds_to_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" gives int8 activations a bfloat16 pool where attention takes bfloat16
    products (the test above: the same outputs in half the memory), and the model's
    float32 elsewhere: where the kernels have no such products, and without
    quantize_activations (where a bfloat16 pool would change outputs)."""
    from pagellm.model import cpu_kernels

    def pool(**kwargs: Any) -> tuple[torch.dtype, int]:
        engine = LLM(kv_cache_memory_bytes=16 << 20, **kwargs).llm_engine
        dtypes = {tensor.dtype for tensor in engine.kv_cache.tensors}
        assert dtypes == {engine.kv_cache_dtype}
        assert engine.get_stats().cache_config["cache_dtype"] == kwargs.get(
            "kv_cache_dtype", "auto")
        return engine.kv_cache_dtype, engine.kv_cache.num_blocks

    float32_pool = pool(quantize_activations=True, kv_cache_dtype="float32")
    bfloat16_pool = pool(quantize_activations=True, kv_cache_dtype="bfloat16")
    assert bfloat16_pool[1] >= 2 * float32_pool[1]  # the same bytes
    rounds = torch.ops.pagellm.bf16_products_available()
    assert pool(quantize_activations=True) == (bfloat16_pool if rounds else float32_pool)
    assert pool()[0] == torch.float32
    monkeypatch.setattr(cpu_kernels, "bf16_products", lambda: False)
    assert pool(quantize_activations=True) == float32_pool


@pytest.mark.slow
def test_every_quantized_weight_takes_the_int8_kernel() -> None:
    """The default model's 4 x 30 Q4_1 layer weights and its Q8_0 head (the tied
    embedding's blocks), the fused layers included."""
    llm = LLM(quantize_activations=True, kv_cache_memory_bytes=16 << 20)
    model = llm.llm_engine.model
    assert model.int8_activation_weights() == 4 * 30 + 1
    assert model.quantized_head is not None and model.quantized_head.int8_activations
    layers = list(model.model.layers)
    assert all(layer.fused_weights is not None for layer in layers)
    assert all(w.int8_activations for layer in layers for w in layer.fused_weights or ())


def test_the_reference_backend_says_caching_may_change_outputs(
        caplog: pytest.LogCaptureFixture) -> None:
    """torch_ref's one SDPA call a request sums in an order that depends on how many
    queries it holds, which int8 rounding turns into other tokens: said at start."""
    with caplog.at_level("WARNING", logger="pagellm.model.llama"):
        LLM(quantize_activations=True, attention_backend="torch_ref",
            kv_cache_memory_bytes=16 << 20)
    assert "attention (the torch_ref backend) cannot take every token through one " \
           "row-invariant kernel" in caplog.text
    assert "caching may change outputs" in caplog.text


@pytest.mark.slow
def test_outputs_stay_close_to_float32() -> None:
    """The same text's prompt logprobs under both: int8 inputs move each by ~0.1 nat
    (measured: 0.11 here, 0.13 over 1,169 tokens of the README, whose mean logprob went
    -3.949 -> -3.967, 1.8% more perplexity), where a kernel reading the wrong codes
    would move them by nats."""
    text = ("The old bridge crosses the river near the market square, where people buy "
            "bread and coffee every morning before they walk to the museum. ") * 3
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    logprobs = []
    for quantize in (False, True):
        llm = LLM(quantize_activations=quantize, kv_cache_memory_bytes=32 << 20)
        out = llm.generate(text, params, use_tqdm=False)[0]
        assert out.prompt_logprobs is not None
        logprobs.append([next(iter(entry.values())).logprob
                         for entry in out.prompt_logprobs[1:]])
        assert_idle(llm.llm_engine)
    diffs = [abs(a - b) for a, b in zip(*logprobs, strict=True)]
    assert sum(diffs) / len(diffs) < 0.25
    assert abs(sum(logprobs[0]) - sum(logprobs[1])) / len(diffs) < 0.1  # 0.067 here


def test_refused_where_it_cannot_run(tmp_path: Path) -> None:
    for kwargs, reason in (({"cpu_kernels": False}, "cpu_kernels=False"),
                           ({"dtype": "bfloat16"}, "dtype='bfloat16'"),
                           ({"device": "cuda"}, "device='cuda'")):
        with pytest.raises(ValueError, match=reason):
            EngineConfig(quantize_activations=True, **kwargs)
    for dtype in ("auto", "float", "float32"):  # "auto" is float32 here
        assert EngineConfig(quantize_activations=True, device="cpu", dtype=dtype).dtype in (
            "auto", "float32")
    with pytest.raises(ValueError, match="must be True or False"):
        EngineConfig(quantize_activations="yes")  # type: ignore[arg-type]
    # A float32 checkpoint has no blocks to multiply.
    tiny = make_tiny_model(tmp_path / "tiny")
    with pytest.raises(ValueError, match="no Q4_1 or Q8_0 blocks|CPU kernels are off"):
        LLM(str(tiny), skip_tokenizer_init=True, quantize_activations=True)


def test_command_line_flag() -> None:
    for flags, expected in ((["--quantize-activations"], True), ([], False),
                            (["--no-quantize-activations"], False)):
        args: Any = build_parser().parse_args(["serve", *flags])
        assert EngineArgs.from_cli_args(args).quantize_activations is expected


def test_a_gpu_by_default_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """device=None means the GPU where torch sees one: refused there before loading."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="device=None"):
        EngineConfig(quantize_activations=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EngineConfig(quantize_activations=True, device="auto").quantize_activations
