"""The 4-bit (Q4_1) matmul kernel: exact dequantisation, results against float64, the
layout, and its use by the default model (attached, checked, same greedy tokens)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pagellm.engine.config import default_cache_dir
from pagellm.model import (
    CorruptModelError,
    LlamaForCausalLM,
    load_model,
    load_model_config,
    resolve_model_path,
)
from pagellm.model import quant_kernels as qk
from pagellm.model.gguf_loader import Q4_1_FILE, QUANTIZED_DIR
from pagellm.model.layers import Linear
from pagellm.model.loader import iter_safetensors, safetensors_files


def _q4_1(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random raw Q4_1 blocks [out, in/32*20] and gguf's own float32 dequantisation."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    blocks = quants.quantize(weight, GGMLQuantizationType.Q4_1)
    dense = quants.dequantize(blocks, GGMLQuantizationType.Q4_1).reshape(weight.shape)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(dense.copy())


@pytest.fixture(scope="module")
def kernels() -> bool:
    if not qk.load_kernels(default_cache_dir() / "kernels"):
        pytest.skip("the Q4_1 kernel cannot be built or run on this machine")
    return True


def test_dequantize_matches_gguf_bit_for_bit() -> None:
    blocks, dense = _q4_1(48, 96)
    assert torch.equal(qk.dequantize_q4_1(blocks, 96), dense)


def test_pack_rejects_shapes_the_tiles_do_not_fit() -> None:
    blocks, _ = _q4_1(48, 96)
    assert not qk.q4_1_packable(40, 96) and not qk.q4_1_packable(48, 80)
    with pytest.raises(ValueError, match="does not fit"):
        qk.pack_q4_1(blocks[:40], 96)
    with pytest.raises(ValueError, match="must be uint8"):
        qk.pack_q4_1(blocks[:, :-1], 96)


def test_pack_layout(kernels: bool) -> None:
    blocks, dense = _q4_1(32, 64)
    packed = qk.pack_q4_1(blocks, 64)
    assert (packed.out_features, packed.in_features) == (32, 64)
    assert packed.scales.shape == (2, 2, 16) and packed.codes.shape == (2, 2, 16, 16)
    # Multiplying by the identity reads the weights back: the kernel rebuilds them exactly.
    assert torch.equal(qk.q4_1_linear(torch.eye(64)[:16], packed), dense.T[:16])
    assert torch.equal(qk.q4_1_linear(torch.eye(64)[48:], packed), dense.T[48:])


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17, qk.MAX_ROWS - 1])
def test_kernel_matches_float64(kernels: bool, rows: int) -> None:
    blocks, dense = _q4_1(96, 576, seed=rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    got = qk.q4_1_linear(x, qk.pack_q4_1(blocks, 576))
    expected = x.double() @ dense.double().T
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    # float32 accumulation over 576 products: the same error as any float32 GEMM's.
    assert (got.double() - expected).abs().max().item() < 1e-5
    assert (x @ dense.T - expected).abs().max().item() < 1e-5


def test_kernel_rejects_bad_inputs(kernels: bool) -> None:
    blocks, _ = _q4_1(32, 64)
    packed = qk.pack_q4_1(blocks, 64)
    with pytest.raises(RuntimeError, match="inputs"):
        qk.q4_1_linear(torch.randn(2, 32), packed)
    with pytest.raises(RuntimeError, match="float32"):
        qk.q4_1_linear(torch.randn(2, 64, dtype=torch.float64), packed)


def test_linear_takes_the_kernel_only_for_small_batches(kernels: bool) -> None:
    blocks, dense = _q4_1(64, 128)
    layer = Linear(128, 64, bias=True)
    layer.weight.data = dense.clone()
    layer.bias.data = torch.randn(64)
    layer.q4_1 = qk.pack_q4_1(blocks, 128)
    layer.pack_for_cpu()
    small = torch.randn(3, 128)
    assert torch.equal(layer(small), qk.q4_1_linear(small, layer.q4_1) + layer.bias)
    large = torch.randn(qk.MAX_ROWS, 128)
    expected = large.double() @ dense.double().T + layer.bias.double()
    assert (layer(large).double() - expected).abs().max().item() < 1e-5


@pytest.fixture(scope="module")
def converted() -> Path:
    return resolve_model_path(None, default_cache_dir())


@pytest.mark.slow
def test_default_model_gets_its_blocks(kernels: bool, converted: Path) -> None:
    assert (converted / QUANTIZED_DIR / Q4_1_FILE).is_file()
    model = load_model(converted, "float32", "cpu", kernel_dir=default_cache_dir() / "kernels")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 30 and all(m.q4_1 is not None for m in linears)
    off = load_model(converted, "float32", "cpu")
    assert all(m.q4_1 is None for m in off.modules() if isinstance(m, Linear))


@pytest.mark.slow
def test_blocks_of_another_layer_are_refused(converted: Path) -> None:
    model = LlamaForCausalLM(load_model_config(converted))
    model.load_weights(iter_safetensors(safetensors_files(converted)))
    blocks = dict(iter_safetensors([converted / QUANTIZED_DIR / Q4_1_FILE]))
    assert model.attach_q4_1([("model.layers.0.mlp.down_proj.weight",
                               blocks["model.layers.0.mlp.down_proj.weight"])]) == 1
    with pytest.raises(CorruptModelError, match="do not match"):
        model.attach_q4_1([("model.layers.1.mlp.down_proj.weight",
                            blocks["model.layers.0.mlp.down_proj.weight"])])
    # A fused layer with a shard missing keeps the float32 path.
    assert model.attach_q4_1([("model.layers.2.self_attn.q_proj.weight",
                               blocks["model.layers.2.self_attn.q_proj.weight"])]) == 0
