"""`kv_cache_dtype="bfloat16"`: the KV pool in half the bytes. On these small models
greedy tokens are identical with the cache on and off, cold and warm (on real models they
may part at near-ties: a recomputed token's float32 noise can tip a key to the next
bfloat16 step; see the README), the same memory holds twice the tokens, and outputs stay
close to the float32 pool's."""

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

# Head dims of 16 (the torch attention paths) and 64 (the compiled kernels' decode,
# cascade and prefill attention); weights drawn at a realistic scale (the default 0.2
# makes logits swing with any rounding).
MODELS: dict[str, dict[str, Any]] = {
    "head-dim-16": {"initializer_range": 0.05},
    "head-dim-64": {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "initializer_range": 0.05},
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kv-dtype")
    return {name: make_tiny_model(root / name, **kw) for name, kw in MODELS.items()}


def _prompts(seed: int) -> list[list[int]]:
    """A shared 70-token beginning with suffixes of several lengths, and one prompt of
    its own: prefix hits and block boundaries (and, on torch's paths, a cascade among
    the decodes; the kernels' cascade needs more shared keys, see test_attention)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(2, 384) for _ in range(70)]
    shared = [prefix + [rng.randrange(2, 384) for _ in range(n)] for n in (1, 5, 16, 23)]
    return [*shared, [rng.randrange(2, 384) for _ in range(41)]]


def _generate(llm: LLM, prompts: list[list[int]], **params: Any) -> list[Any]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                          **params), use_tqdm=False)
    assert_idle(llm.llm_engine)
    return outputs


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("name", list(MODELS))
def test_bfloat16_pool_agrees_with_caching_on_and_off(name: str, cpu_kernels: bool,
                                                     tiny_models: dict[str, Path]) -> None:
    runs = {}
    for caching in (False, True):
        llm = LLM(str(tiny_models[name]), skip_tokenizer_init=True, kv_cache_dtype="bfloat16",
                  enable_prefix_caching=caching, cpu_kernels=cpu_kernels,
                  kv_cache_memory_bytes=2 << 20, max_num_batched_tokens=64)
        assert all(t.dtype == torch.bfloat16 for t in llm.llm_engine.kv_cache.tensors)
        cold = [o.outputs[0].token_ids for o in _generate(llm, _prompts(3))]
        warm = [o.outputs[0].token_ids for o in _generate(llm, _prompts(3))]
        assert warm == cold
        runs[caching] = cold
        if caching:
            assert llm.llm_engine.get_stats().prefix_cache_hits > 0
    assert runs[True] == runs[False]


@pytest.mark.parametrize("name", list(MODELS))
def test_bfloat16_pool_holds_twice_the_tokens(name: str, tiny_models: dict[str, Path],
                                              caplog: pytest.LogCaptureFixture) -> None:
    engines = {dtype: LLM(str(tiny_models[name]), skip_tokenizer_init=True,
                          kv_cache_dtype=dtype, kv_cache_memory_bytes=2 << 20).llm_engine
               for dtype in ("auto", "bfloat16", "float32")}
    assert engines["bfloat16"].kv_cache.num_blocks == 2 * engines["auto"].kv_cache.num_blocks
    assert engines["float32"].kv_cache.num_blocks == engines["auto"].kv_cache.num_blocks
    assert engines["auto"].kv_cache_dtype == engines["float32"].kv_cache_dtype == torch.float32
    # In blocks (num_gpu_blocks_override), a pool holds as many tokens either way.
    for dtype in ("auto", "bfloat16"):
        engine = LLM(str(tiny_models[name]), skip_tokenizer_init=True, kv_cache_dtype=dtype,
                     kv_cache_memory_bytes=2 << 20, num_gpu_blocks_override=5).llm_engine
        assert engine.kv_cache.num_blocks == 5 and engine.max_model_len == 5 * 16
    assert "raise num_gpu_blocks_override (--num-gpu-blocks-override) for more" in caplog.text
    # It wins over a fraction of free memory too.
    engine = LLM(str(tiny_models[name]), skip_tokenizer_init=True, num_gpu_blocks_override=3,
                 kv_cache_memory_fraction=0.5).llm_engine
    assert engine.kv_cache.num_blocks == 3
    for dtype, engine in engines.items():
        assert engine.get_stats().cache_config["cache_dtype"] == dtype


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("name", list(MODELS))
def test_bfloat16_pool_reads_close_to_float32(name: str, cpu_kernels: bool,
                                              tiny_models: dict[str, Path]) -> None:
    """Every prompt position's log-probability (each attends over the pool, the step's
    own keys included) under a bfloat16 pool stays near the float32 pool's: a pool that
    was never written, or read as the wrong type, is far off."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in _prompts(11)]
    got = {}
    for dtype in ("auto", "bfloat16"):
        llm = LLM(str(tiny_models[name]), skip_tokenizer_init=True, kv_cache_dtype=dtype,
                  cpu_kernels=cpu_kernels, kv_cache_memory_bytes=2 << 20,
                  max_num_batched_tokens=64)
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[dtype] = torch.tensor([next(iter(entry.values())).logprob for out in outs
                                   for entry in out.prompt_logprobs if entry is not None])
    diff = (got["auto"] - got["bfloat16"]).abs()
    assert diff.numel() > 150
    # Measured: mean 0.0015, max 0.005; with the bfloat16 pool never written, 0.83 and 3.6.
    assert float(diff.mean()) < 0.01 and float(diff.max()) < 0.05, (diff.mean(), diff.max())


@pytest.mark.slow
def test_bfloat16_pool_stays_close_on_the_default_model(default_model_dir: Path) -> None:
    """On real weights and text the rounding moves each greedy token's log-probability
    by little: where the float32 and bfloat16 pools chose alike, within 0.05, and they
    choose alike on most tokens. (A random tiny model, whose large weights amplify any
    rounding, moved by 0.08: not a measure of what users see.)"""
    prompts = [[{"role": "system", "content": "You are a concise assistant who answers "
                 "questions about European cities with short, factual sentences."},
                {"role": "user", "content": question}]
               for question in ("What should I see in Paris?", "How do I get around Berlin?",
                                "Which food is typical in Rome?", "Is Vienna expensive?")]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = {}
    for dtype in ("auto", "bfloat16"):
        llm = LLM(str(default_model_dir), kv_cache_dtype=dtype, kv_cache_memory_bytes=48 << 20)
        outs[dtype] = llm.chat(prompts, params, use_tqdm=False)
        assert_idle(llm.llm_engine)
    alike = 0  # tokens before each request's first difference (all 96 here: 0.016 at most)
    for a, b in zip(outs["auto"], outs["bfloat16"], strict=True):
        pairs = zip(a.outputs[0].token_ids, b.outputs[0].token_ids,
                    a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True)
        for token_a, token_b, lp_a, lp_b in pairs:
            if token_a != token_b:
                break
            assert abs(lp_a[token_a].logprob - lp_b[token_b].logprob) < 0.05
            alike += 1
    assert alike >= 0.75 * len(prompts) * 24


def test_auto_is_the_models_dtype_unless_attention_rounds_to_bfloat16() -> None:
    """The resolution alone (the model's attribute is set where quantize_activations
    puts attention on bfloat16 products; see test_quantize_activations): a named dtype
    is always what it names."""
    from types import SimpleNamespace

    from pagellm.engine.llm_engine import _kv_cache_dtype

    for rounds in (False, True):
        model: Any = SimpleNamespace(attention_rounds_kv_to_bf16=rounds)
        assert _kv_cache_dtype("auto", torch.float32, model) == (
            torch.bfloat16 if rounds else torch.float32)
        assert _kv_cache_dtype("float32", torch.float32, model) == torch.float32
        assert _kv_cache_dtype("bfloat16", torch.float32, model) == torch.bfloat16


def test_kv_cache_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, float32"):
        LLM(kv_cache_dtype="fp8")
    for dtype in ("bfloat16", "half"):
        with pytest.raises(ValueError, match="kv_cache_dtype='float32' is a float32 model"):
            EngineConfig(dtype=dtype, kv_cache_dtype="float32")
    assert EngineConfig(kv_cache_dtype=torch.float32).kv_cache_dtype == "float32"
    assert EngineArgs.from_cli_args(build_parser().parse_args(
        ["generate", "x", "--kv-cache-dtype", "float32"])).kv_cache_dtype == "float32"
    with pytest.raises(ValueError, match="got 'float16'"):
        LLM(kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="with dtype='float16' saves no memory"):
        LLM(dtype="half", kv_cache_dtype="bfloat16")


@pytest.mark.slow
def test_bfloat16_pool_parts_from_caching_off_only_at_near_ties(
        default_model_dir: Path) -> None:
    """The README's caveat, measured: a warm request (its prompt's tail computed again in
    a smaller batch) against caching off, on a chat a review found to part. Until they
    part, each token's log-probability agrees within 0.05; where they part, the two
    tokens were within 0.02 of each other under caching off (a near-tie)."""
    chat = [{"role": "user", "content": "Write a short story involving photosynthesis."}]
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
    off = LLM(str(default_model_dir), kv_cache_dtype="bfloat16", enable_prefix_caching=False,
              kv_cache_memory_bytes=48 << 20).chat(chat, params, use_tqdm=False)[0].outputs[0]
    llm = LLM(str(default_model_dir), kv_cache_dtype="bfloat16", kv_cache_memory_bytes=48 << 20)
    llm.chat(chat, params, use_tqdm=False)
    warm = llm.chat(chat, params, use_tqdm=False)[0]
    assert warm.num_cached_tokens > 0
    ours = warm.outputs[0]
    for i, (a, b) in enumerate(zip(off.token_ids, ours.token_ids, strict=True)):
        if a != b:
            assert b in off.logprobs[i], "parted on a token caching off ranked below 2nd"
            assert off.logprobs[i][a].logprob - off.logprobs[i][b].logprob < 0.02
            break
        assert abs(off.logprobs[i][a].logprob - ours.logprobs[i][b].logprob) < 0.05
