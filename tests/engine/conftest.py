"""Shared fixtures for engine tests: tiny random models, the default model, the reference.

The reference is Hugging Face `transformers` with the same weights in float32, greedy.
Greedy paths may legitimately part at a true near-tie (float round-off differs between
computing a prompt in one GEMM and in pieces); `assert_greedy_equal` accepts a difference
only when, at the first differing position, the reference's log-probabilities of the two
tokens differ by less than 1e-3, and counts those cases so the suite reports them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NEAR_TIE = 1e-3
near_tie_cases: list[str] = []


def make_tiny_model(path: Path, arch: str = "llama", **overrides: Any) -> Path:
    """Saves a random-weight model of `arch` (float32, safetensors) into `path`."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, tie_word_embeddings=False, eos_token_id=1, bos_token_id=0,
    )
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    torch.manual_seed(1234)
    model = model_cls(config_cls(**common)).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain argmax decoding with the reference's own KV cache, never stopping at EOS
    (our side runs with ignore_eos)."""
    tokens: list[int] = []
    with torch.no_grad():
        result = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_new_tokens):
            tokens.append(int(result.logits[0, -1].argmax()))
            result = model(torch.tensor([[tokens[-1]]]), past_key_values=result.past_key_values,
                           use_cache=True)
    return tokens


def assert_greedy_equal(model: Any, prompt: list[int], ours: list[int], ref: list[int],
                        label: str = "") -> None:
    """Ours must equal the reference, except after a true near-tie (see module doc)."""
    if ours == ref:
        return
    n = min(len(ours), len(ref))
    first = next((i for i in range(n) if ours[i] != ref[i]), n)
    assert first < n, f"{label}: lengths differ: ours {len(ours)} vs reference {len(ref)}"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:first]])).logits[0, -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    gap = abs(float(logprobs[ours[first]] - logprobs[ref[first]]))
    assert gap < NEAR_TIE, (
        f"{label}: greedy tokens differ at position {first}: ours {ours[first]} vs "
        f"reference {ref[first]} (logprob gap {gap:.2e}, not a near-tie)\n"
        f"ours={ours}\nref ={ref}")
    near_tie_cases.append(f"{label} at {first} (gap {gap:.1e})")


def assert_idle(engine: Any) -> None:
    """The leak check: an idle engine holds no block and every ref count is 0."""
    assert not engine.has_unfinished_requests()
    pool = engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_count == 0 for block in pool.blocks)
    assert not engine.kv_manager.req_to_blocks


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from pagellm.cache_dir import resolve_cache_dir
    from pagellm.model.resolve import resolve_model_path

    return resolve_model_path(None, resolve_cache_dir())


@pytest.fixture(scope="session")
def default_hf_model(default_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_llm() -> Iterator[Any]:
    from pagellm import LLM

    llm = LLM(kv_cache_memory_bytes=48 << 20, max_num_batched_tokens=1024)
    yield llm
    assert_idle(llm.llm_engine)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if near_tie_cases:
        terminalreporter.write_line(
            f"greedy near-ties accepted (|logprob gap| < {NEAR_TIE}): {len(near_tie_cases)}")
        for case in near_tie_cases:
            terminalreporter.write_line(f"  {case}")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight tiny Llama (see make_tiny_model), for the tests that need one model
    and its `reference`."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def reference(tiny: Path) -> Any:
    """`tiny` in transformers, float32: what greedy outputs are checked against."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
