"""Our models against transformers' own, on tiny random checkpoints of every architecture.

Each checkpoint is built by transformers with random weights (perturbed so biases and
norm scales are not their trivial init values, which would hide a mis-mapped tensor),
saved as safetensors, and loaded by our loader. Every paged schedule must reproduce the
reference's logits for a plain forward over the whole sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from paged_sim import PagedSim
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from pagellm.cache_dir import resolve_cache_dir
from pagellm.model import ATTENTION_BACKENDS, cpu_kernels, load_model

ATOL = 1e-4
SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=160,
    max_position_embeddings=256,
    initializer_range=0.15,
)

CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama_gqa": lambda: LlamaConfig(**SMALL, num_key_value_heads=2),
    "llama_mha_tied": lambda: LlamaConfig(**SMALL, num_key_value_heads=4, tie_word_embeddings=True),
    "llama_bias": lambda: LlamaConfig(
        **SMALL, num_key_value_heads=2, attention_bias=True, mlp_bias=True
    ),
    "llama_rope_llama3": lambda: LlamaConfig(
        **SMALL,
        num_key_value_heads=2,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama_rope_linear": lambda: LlamaConfig(
        **SMALL,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.5},
    ),
    "mistral_sliding": lambda: MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=6),
    "qwen2_bias_tied": lambda: Qwen2Config(
        **SMALL, num_key_value_heads=2, tie_word_embeddings=True
    ),
    "qwen3_qknorm": lambda: Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=24),
    # 64-dim heads: the size the compiled attention kernels serve.
    "llama_head64": lambda: LlamaConfig(
        **{**SMALL, "hidden_size": 128, "num_attention_heads": 2}, num_key_value_heads=1
    ),
}

# The batched backend with the compiled CPU kernels: fused norms, silu and rotary, paged
# attention kernels where the head size fits (see cpu_kernels).
KERNELS = "torch_batched+cpu_kernels"
BACKENDS = [*sorted(ATTENTION_BACKENDS), KERNELS]


class Reference:
    """A saved tiny checkpoint and transformers' logits for token sequences on it."""

    def __init__(self, hf_model: Any, path: Path) -> None:
        self.hf_model = hf_model
        self.path = path
        self.vocab = hf_model.config.vocab_size

    def sequence(self, seed: int, length: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.vocab, (length,), generator=gen).tolist()

    def logits(self, tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.hf_model(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def reference(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Reference:
    torch.manual_seed(0)
    config = CONFIGS[request.param]()
    hf_model = AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(path)
    return Reference(hf_model, path)


@pytest.fixture(params=BACKENDS)
def sim(request: pytest.FixtureRequest, reference: Reference) -> PagedSim:
    kernel_dir = None
    if request.param == KERNELS:
        kernel_dir = resolve_cache_dir() / "kernels"
        if not cpu_kernels.load(kernel_dir):
            pytest.skip("the CPU kernels cannot be built or run on this machine")
    model = load_model(reference.path, "float32", "cpu",
                       attention_backend=request.param.removesuffix("+cpu_kernels"),
                       kernel_dir=kernel_dir)
    return PagedSim(model, block_size=4, seed=hash(request.param) % 1000)


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    assert theirs.std() > 0.1, "reference logits too flat to be a meaningful comparison"
    diff = (ours - theirs).abs().max().item()
    assert diff < ATOL, f"max |logit diff| {diff:.2e}"


def test_full_prefill(reference: Reference, sim: PagedSim) -> None:
    tokens = reference.sequence(1, 23)
    assert_close(sim.step([("a", tokens)]), reference.logits(tokens))


def test_cached_prefix_then_suffix(reference: Reference, sim: PagedSim) -> None:
    tokens = reference.sequence(2, 23)
    expected = reference.logits(tokens)
    assert_close(sim.step([("a", tokens[:12])]), expected[:12])
    sim.share_prefix("a", "b", 12)
    assert_close(sim.step([("b", tokens[12:])]), expected[12:])


def test_chunked_prefill(reference: Reference, sim: PagedSim) -> None:
    tokens = reference.sequence(3, 26)
    chunks = [tokens[i : i + 7] for i in range(0, len(tokens), 7)]
    got = torch.cat([sim.step([("a", chunk)]) for chunk in chunks])
    assert_close(got, reference.logits(tokens))


def test_decode_steps(reference: Reference, sim: PagedSim) -> None:
    tokens = reference.sequence(4, 24)
    expected = reference.logits(tokens)
    assert_close(sim.step([("a", tokens[:15])]), expected[:15])
    for pos in range(15, 24):
        assert_close(sim.step([("a", [tokens[pos]])]), expected[pos : pos + 1])


def test_mixed_batch(reference: Reference, sim: PagedSim) -> None:
    x, y, z = (reference.sequence(seed, n) for seed, n in ((5, 10), (6, 13), (7, 19)))
    ex, ey, ez = (reference.logits(s) for s in (x, y, z))
    sim.step([("y", y[:10]), ("z0", z[:8])])
    sim.share_prefix("z0", "z", 8)
    # A fresh prefill, a decode and a prefill over a cached prefix in one forward.
    got = sim.step([("x", x[:9]), ("y", [y[10]]), ("z", z[8:17])])
    assert_close(got[:9], ex[:9])
    assert_close(got[9:10], ey[10:11])
    assert_close(got[10:], ez[8:17])
    # Then all three decode together.
    got = sim.step([("x", [x[9]]), ("y", [y[11]]), ("z", [z[17]])])
    assert_close(got, torch.stack([ex[9], ey[11], ez[17]]))
