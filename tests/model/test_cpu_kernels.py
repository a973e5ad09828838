"""The compiled CPU kernels: quantized (Q4_1, Q8_0) matmuls (exact dequantisation,
results against float64, the layout, their use by the default model) and the fused small
ops against the torch formulas they replace. The paged attention kernels are tested
with the other attention backends (test_attention.py)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from paged_sim import PagedSim

from pagellm.cache_dir import resolve_cache_dir
from pagellm.model import (
    CorruptModelError,
    LlamaForCausalLM,
    cpu_kernels,
    load_model,
    load_model_config,
    resolve_model_path,
)
from pagellm.model import quant_kernels as qk
from pagellm.model.attention import batched
from pagellm.model.attention.base import StepPlan
from pagellm.model.attention_metadata import AttentionMetadata
from pagellm.model.gguf_loader import BLOCKS_FILE, QUANTIZED_DIR
from pagellm.model.layers import GatedMLP, Linear, RMSNorm
from pagellm.model.loader import iter_quantized_blocks, iter_safetensors, safetensors_files
from pagellm.model.model_config import ModelConfig
from pagellm.model.rotary import apply_rotary

FORMATS = sorted(qk.FORMATS)


def _blocks(fmt: str, out_features: int, in_features: int,
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random raw blocks [out, in/32*bytes] and gguf's own float32 dequantisation."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    kind = GGMLQuantizationType[fmt]
    blocks = quants.quantize(weight, kind)
    dense = quants.dequantize(blocks, kind).reshape(weight.shape)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(dense.copy())


@pytest.fixture(scope="module")
def kernels() -> bool:
    if not cpu_kernels.load(resolve_cache_dir() / "kernels"):
        pytest.skip("the quantized kernels cannot be built or run on this machine")
    return True


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_gguf_bit_for_bit(fmt: str) -> None:
    blocks, dense = _blocks(fmt, 48, 96)
    assert torch.equal(qk.dequantize(qk.FORMATS[fmt], blocks, 96), dense)


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_rejects_shapes_the_tiles_do_not_fit(fmt: str) -> None:
    blocks, _ = _blocks(fmt, 48, 96)
    assert not qk.packable(40, 96) and not qk.packable(48, 80)
    with pytest.raises(ValueError, match="does not fit"):
        qk.pack(qk.FORMATS[fmt], blocks[:40], 96)
    with pytest.raises(ValueError, match="must be uint8"):
        qk.pack(qk.FORMATS[fmt], blocks[:, :-1], 96)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_rebuilds_the_weights_exactly(kernels: bool, fmt: str) -> None:
    blocks, dense = _blocks(fmt, 96, 320)
    packed = qk.pack(qk.FORMATS[fmt], blocks, 320)
    assert (packed.out_features, packed.in_features) == (96, 320)
    # Multiplying by the identity reads the weights back, bit for bit: through the
    # register tiles (Q4_1 factored, its block sums 8 blocks at a time and then one by
    # one: 10 blocks), every pass size, low and high nibbles (inputs j and j + 16 of a
    # block),
    eye = torch.eye(320)
    for rows in (slice(0, 1), slice(16, 17), slice(40, 42), slice(0, 3), slice(58, 62),
                 slice(10, 16), slice(0, 8), slice(56, 64), slice(250, 258),
                 slice(312, 320)):
        assert torch.equal(qk.quantized_linear(eye[rows], packed), dense.T[rows]), rows
    # past that through float32 panels of two tiles, three of them here (so a thread
    # fetches its next panel's blocks while it multiplies one), or AMX tiles;
    assert torch.equal(qk.quantized_linear(eye[:9], packed), dense.T[:9])
    assert torch.equal(qk.quantized_linear(eye, packed), dense.T)
    # and with an odd number of tiles, on register tiles still, pass after pass.
    odd = qk.pack(qk.FORMATS[fmt], blocks[:48], 320)
    assert torch.equal(qk.quantized_linear(eye[290:], odd), dense[:48].T[290:])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 9, 13, 16, 25, 37, 63, 130, 600])
@pytest.mark.parametrize("out", [96, 48])
def test_kernel_matches_float64(kernels: bool, fmt: str, rows: int, out: int) -> None:
    """Every row-count path: register tiles (<= 8 rows with AVX-512, <= 6 with AVX2; for
    Q4_1 factored, with two sums a row up to 4 and 2 rows), panels of two tiles (more
    rows, split evenly into passes of at most 12 rows with AVX-512 or 3 with AVX2, in
    sweeps of 512 rows), and an odd tile count, which keeps to the register tiles."""
    blocks, dense = _blocks(fmt, out, 576, seed=rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    got = qk.quantized_linear(x, qk.pack(qk.FORMATS[fmt], blocks, 576))
    expected = x.double() @ dense.double().T
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    # float32 accumulation over 576 products: the same error as any float32 GEMM's.
    assert (got.double() - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("in_features", [32, 64, 1536])
@pytest.mark.parametrize("rows", [9, 64, 65, 200])
def test_many_rows_at_every_depth(kernels: bool, fmt: str, in_features: int,
                                  rows: int) -> None:
    """Past the register tiles, at one block of inputs, a few and many: on AMX a block's
    codes are unpacked while the tiles multiply the block before, in the first pass over
    the rows only (64 rows a pass), and later passes reuse them. Matches float64, and
    identity rows read the weights back bit for bit wherever they sit among the rows."""
    blocks, dense = _blocks(fmt, 96, in_features, seed=rows + in_features)
    packed = qk.pack(qk.FORMATS[fmt], blocks, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    eye = torch.eye(in_features)
    picks = torch.arange(0, in_features, max(1, in_features // 8))[:rows]
    at = torch.linspace(0, rows - 1, len(picks)).long()
    x[at] = eye[picks]
    got = qk.quantized_linear(x, packed)
    assert torch.equal(got[at], dense.T[picks])
    # The float32 panels' error grows with the depth they add up (1.2e-5 at 1,536 inputs
    # without AMX), so the bound of 576 inputs is scaled to it.
    bound = max(1e-6, 1e-5 * in_features / 576)
    assert (got.double() - x.double() @ dense.double().T).abs().max().item() < bound


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 8, 9, 13, 40, 600])
def test_gated_kernel_is_silu_mul_of_the_product_bit_for_bit(
        kernels: bool, fmt: str, rows: int) -> None:
    """The gated kernel (tiles in (gate, up) pairs, silu(gate) * up in the epilogue) gives
    exactly the plain product followed by the silu_mul op, through the register tiles and
    the panels; its reported width is half the tiles' rows."""
    blocks, _ = _blocks(fmt, 2 * 96, 64, seed=rows)
    plain = qk.pack(qk.FORMATS[fmt], blocks, 64)
    gated = qk.gate_up_pairs(plain)
    assert gated.gated and (gated.out_features, gated.in_features) == (96, 64)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    expected = torch.ops.pagellm.silu_mul(qk.quantized_linear(x, plain))
    assert torch.equal(qk.quantized_linear(x, gated), expected)
    with pytest.raises(ValueError, match="even number of unpaired tiles"):
        qk.gate_up_pairs(gated)
    with pytest.raises(ValueError, match="even number of unpaired tiles"):
        qk.gate_up_pairs(qk.pack(qk.FORMATS[fmt], blocks[:48], 64))


def test_gated_mlp_takes_the_gated_kernel_only_where_it_fits(kernels: bool) -> None:
    blocks, dense = _blocks("Q4_1", 2 * 32, 64)
    mlp = GatedMLP(64, 32, bias=False)
    mlp.fused = True
    mlp.gate_up_proj.weight.data = dense.clone()
    mlp.down_proj.weight.data = torch.randn(64, 32) * 0.1
    x = torch.randn(5, 64)
    unfused = mlp(x)
    assert not mlp.use_gated_kernel()  # no blocks yet
    mlp.gate_up_proj.quantized = qk.pack(qk.FORMATS["Q4_1"], blocks, 64)
    assert mlp.use_gated_kernel() and mlp.use_gated_kernel()  # pairs once, then a no-op
    gated = mlp.gate_up_proj.quantized
    assert gated is not None and gated.gated and gated.out_features == 32
    # Its blocks serve the MLP, not the Linear itself (whose output is the whole product).
    assert torch.equal(mlp.gate_up_proj(x), torch.nn.functional.linear(x, dense))
    # Same float32 weights, other summation order than the dense GEMM's.
    torch.testing.assert_close(mlp(x), unfused, atol=1e-6, rtol=1e-5)
    # A 3-D input keeps the layer's float32 weight.
    torch.testing.assert_close(mlp(x[None])[0], unfused, atol=1e-6, rtol=1e-5)
    odd = GatedMLP(64, 24, bias=False)  # halves of 1.5 tiles
    odd.gate_up_proj.quantized = qk.pack(qk.FORMATS["Q4_1"], _blocks("Q4_1", 48, 64)[0], 64)
    assert not odd.use_gated_kernel() and not odd.gate_up_proj.quantized.gated
    biased = GatedMLP(64, 32, bias=True)
    biased.gate_up_proj.quantized = qk.pack(qk.FORMATS["Q4_1"], blocks, 64)
    assert not biased.use_gated_kernel() and not biased.gate_up_proj.quantized.gated


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gated", [False, True])
def test_panel_rows_do_not_depend_on_the_other_rows(kernels: bool, fmt: str, gated: bool) -> None:
    """Above the register tiles (8 rows; 6 or 4 with AVX2), a row's result is the same
    bits whatever else is in the call: how many rows, where the row sits in its pass of
    rows, and which 512-row sweep (on AMX: which chunk of rows) holds it. The engine relies on it: a prompt computed in
    one chunk or in several, or next to other requests, must give the same hidden states
    (caching on and off give the same tokens)."""
    blocks, _ = _blocks(fmt, 2 * 96, 1536, seed=7)
    packed = qk.pack(qk.FORMATS[fmt], blocks, 1536)
    weight = qk.gate_up_pairs(packed) if gated else packed
    x = torch.randn(700, 1536, generator=torch.Generator().manual_seed(7))
    full = qk.quantized_linear(x, weight)
    for start, rows in [(0, 9), (0, 10), (0, 11), (3, 13), (5, 25), (100, 37), (0, 520),
                        (180, 520)]:
        part = qk.quantized_linear(x[start:start + rows], weight)
        assert torch.equal(part, full[start:start + rows]), (start, rows)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6])
def test_tile_rows_depend_only_on_their_pass_size(kernels: bool, fmt: str, rows: int) -> None:
    """In the register tiles a row's bits may depend on how many rows share its pass (Q4_1
    keeps two sums a row for 1-2 rows with AVX2), never on the other rows' values."""
    blocks, _ = _blocks(fmt, 96, 576, seed=rows)
    packed = qk.pack(qk.FORMATS[fmt], blocks, 576)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=generator)
    other = torch.randn(rows, 576, generator=generator)
    other[0] = x[0]
    assert torch.equal(qk.quantized_linear(other, packed)[0], qk.quantized_linear(x, packed)[0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_rejects_bad_inputs(kernels: bool, fmt: str) -> None:
    blocks, _ = _blocks(fmt, 32, 64)
    packed = qk.pack(qk.FORMATS[fmt], blocks, 64)
    with pytest.raises(RuntimeError, match="inputs"):
        qk.quantized_linear(torch.randn(2, 32), packed)
    with pytest.raises(RuntimeError, match="float32"):
        qk.quantized_linear(torch.randn(2, 64, dtype=torch.float64), packed)
    # The scales and mins are the GGUF's float16, as pack keeps them; float32 ones are
    # refused by name, for both kernels.
    assert packed.scales.dtype == torch.float16
    assert packed.mins is None or packed.mins.dtype == torch.float16
    widened = dataclasses.replace(packed, scales=packed.scales.float())
    for weight in (widened, qk.int8_activation_layout(widened)):
        with pytest.raises(RuntimeError, match="scales must be float16"):
            qk.quantized_linear(torch.randn(2, 64), weight)
    if packed.mins is not None:
        wide_mins = dataclasses.replace(packed, mins=packed.mins.float())
        for weight in (wide_mins, qk.int8_activation_layout(wide_mins)):
            with pytest.raises(RuntimeError, match="mins must match scales"):
                qk.quantized_linear(torch.randn(2, 64), weight)


@pytest.mark.parametrize("fmt", FORMATS)
def test_float16_scales_and_mins_widen_exactly(kernels: bool, fmt: str) -> None:
    """Blocks whose float16 scale or min is a subnormal, or a zero of either sign, read
    back through the identity as dequantize gives them, bit for bit: on the register
    tiles and on the panels (the scales are widened as the kernels load them)."""
    blocks, _ = _blocks(fmt, 64, 128, seed=3)
    fields = blocks.view(64, 4, qk.FORMATS[fmt].block_bytes)
    specials = torch.tensor([2**-24, -(2**-24), 3 * 2**-20, 0.0, -0.0, 2**-14],
                            dtype=torch.float16).view(torch.uint8).view(-1, 2)
    generator = torch.Generator().manual_seed(0)
    for start in (0, 2):  # the scale, then Q4_1's min
        if start == 2 and fmt != "Q4_1":
            continue
        picks = torch.randint(0, 64 * 4, (40,), generator=generator)
        chosen = specials[torch.randint(0, len(specials), (40,), generator=generator)]
        fields.view(-1, fields.shape[-1])[picks, start:start + 2] = chosen
    dense = qk.dequantize(qk.FORMATS[fmt], blocks, 128)
    packed = qk.pack(qk.FORMATS[fmt], blocks, 128)
    eye = torch.eye(128)
    for rows in (slice(0, 1), slice(30, 33), slice(0, 8), slice(0, 128)):
        assert torch.equal(qk.quantized_linear(eye[rows], packed), dense.T[rows]), rows


def test_linear_with_blocks_takes_the_kernel_for_every_batch(kernels: bool) -> None:
    blocks, dense = _blocks("Q4_1", 64, 128)
    layer = Linear(128, 64, bias=True)
    layer.weight.data = dense.clone()
    layer.bias.data = torch.randn(64)
    layer.quantized = qk.pack(qk.FORMATS["Q4_1"], blocks, 128)
    layer.pack_for_cpu()
    assert not layer.packed  # no oneDNN copy beside the blocks
    for rows in (3, 1100):
        x = torch.randn(rows, 128)
        assert torch.equal(layer(x), qk.quantized_linear(x, layer.quantized) + layer.bias)
        expected = x.double() @ dense.double().T + layer.bias.double()
        assert (layer(x).double() - expected).abs().max().item() < 1e-5


@pytest.fixture(scope="module")
def converted() -> Path:
    return resolve_model_path(None, resolve_cache_dir())


@pytest.mark.slow
def test_default_model_gets_its_blocks(kernels: bool, converted: Path) -> None:
    formats = {fmt for _, fmt, _ in iter_quantized_blocks(converted / QUANTIZED_DIR / BLOCKS_FILE)}
    assert formats == {"Q4_1", "Q8_0"}  # the layers, and the tied embedding / head
    model = load_model(converted, "float32", "cpu", kernel_dir=resolve_cache_dir() / "kernels")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    mlps = [m for m in model.modules() if isinstance(m, GatedMLP)]
    # gate_up's blocks move to its MLP's gated kernel.
    assert len(linears) == 4 * 30 and len(mlps) == 30
    assert all(m.gate_up_proj.quantized is not None and m.gate_up_proj.quantized.gated
               for m in mlps)
    assert not any(m.packed for m in linears)  # no oneDNN copy that never runs
    assert all(m.quantized is not None for m in linears)
    assert model.quantized_head is not None
    assert all(layer.fused_weights is not None for layer in model.model.layers)
    hidden = torch.randn(5, model.config.hidden_size)
    table = model.model.embed_tokens.weight
    expected = hidden.double() @ table.double().T
    assert (model.compute_logits(hidden).double() - expected).abs().max().item() < 1e-4
    off = load_model(converted, "float32", "cpu")
    assert off.quantized_head is None
    assert all(m.quantized is None for m in off.modules() if isinstance(m, Linear))
    assert all(layer.fused_weights is None for layer in off.model.layers)


@pytest.mark.slow
def test_blocks_of_another_layer_are_refused(converted: Path) -> None:
    model = LlamaForCausalLM(load_model_config(converted))
    model.load_weights(iter_safetensors(safetensors_files(converted)))
    blocks = {name: raw for name, _, raw in
              iter_quantized_blocks(converted / QUANTIZED_DIR / BLOCKS_FILE)}
    down = blocks["model.layers.0.mlp.down_proj.weight"]
    assert model.attach_quantized([("model.layers.0.mlp.down_proj.weight", "Q4_1", down)]) == 1
    with pytest.raises(CorruptModelError, match="do not match"):
        model.attach_quantized([("model.layers.1.mlp.down_proj.weight", "Q4_1", down)])
    # A fused layer with a shard missing keeps the float32 path.
    q = blocks["model.layers.2.self_attn.q_proj.weight"]
    assert model.attach_quantized([("model.layers.2.self_attn.q_proj.weight", "Q4_1", q)]) == 0
    # Reloading the weights drops the blocks attached to the old ones.
    gate_up = blocks["model.layers.3.mlp.gate_proj.weight"], blocks["model.layers.3.mlp.up_proj.weight"]
    assert model.attach_quantized([("model.layers.3.mlp.gate_proj.weight", "Q4_1", gate_up[0]),
                                   ("model.layers.3.mlp.up_proj.weight", "Q4_1", gate_up[1])]) == 1
    gated = model.model.layers[3].mlp.gate_up_proj.quantized
    assert gated is not None and gated.gated
    model.load_weights(iter_safetensors(safetensors_files(converted)))
    assert all(m.quantized is None for m in model.modules() if isinstance(m, Linear))


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("width", [64, 100])
def test_fused_norms_match_torch(kernels: bool, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * width)
    norm = RMSNorm(width, 1e-5)
    norm.weight.data = torch.randn(width, generator=gen)
    x, residual = torch.randn(2, rows, width, generator=gen)
    expected = norm(x)
    expected_sum_norm, expected_sum = norm.add_norm(x, residual)
    norm.fused = True
    torch.testing.assert_close(norm(x), expected, rtol=1e-6, atol=1e-6)
    # A 3-D input (per-head q/k norms) is normalised along its last dimension.
    torch.testing.assert_close(norm(x.view(rows, 1, width)), expected.view(rows, 1, width),
                               rtol=1e-6, atol=1e-6)
    got_norm, got_sum = norm.add_norm(x, residual)
    assert torch.equal(got_sum, expected_sum)
    torch.testing.assert_close(got_norm, expected_sum_norm, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_fused_silu_mul_matches_torch(kernels: bool, rows: int) -> None:
    mlp = GatedMLP(32, 48, bias=False)
    gen = torch.Generator().manual_seed(rows)
    mlp.gate_up_proj.weight.data = torch.randn(96, 32, generator=gen)
    mlp.down_proj.weight.data = torch.randn(32, 48, generator=gen)
    x = torch.randn(rows, 32, generator=gen) * 3
    expected = mlp(x)
    mlp.fused = True
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)


def test_fused_rotary_is_bit_exact(kernels: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, dim = 6, 4, 2, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = torch.randn(rows, dim // 2, generator=gen) * 20
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    expected_q = apply_rotary(q.reshape(rows, heads, dim), cos, sin)
    expected_k = apply_rotary(k.reshape(rows, kv_heads, dim), cos, sin)
    expected_v = v.clone()
    torch.ops.pagellm.rotary_(qkv, heads + kv_heads, cos, sin)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    assert torch.equal(q.reshape(rows, heads, dim), expected_q)
    assert torch.equal(k.reshape(rows, kv_heads, dim), expected_k)
    assert torch.equal(v, expected_v)


@pytest.mark.parametrize("width", [1, 5, 16, 17, 40, 1000])
def test_argmax_rows_follows_torch_argmax(kernels: bool, width: int) -> None:
    """Lowest index on ties (within a vector's lanes, across them and in the tail), the
    first NaN when there is one, index 0 for a row of -inf."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randint(-3, 4, (12, width), generator=gen).float()  # many ties
    x[1] = float("-inf")
    x[2, width // 2] = float("nan")
    x[3, width - 1] = float("nan")
    x[3, 0] = float("inf")
    x[4, width - 1] = 10.0
    x[5] = torch.randn(width, generator=gen)
    if width > 16:
        x[6, 17:] = float("nan")  # a NaN in the second vector and the tail
        x[7, width - 1] = x[7, 3] = 20.0  # a tie between the first vector and the tail
    got = torch.ops.pagellm.argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))


def test_argmax_rows_rejects_bad_inputs(kernels: bool) -> None:
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.pagellm.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="empty"):
        torch.ops.pagellm.argmax_rows(torch.zeros(2, 0))


def _quantized_tiny_llama(
    fmt: str, without_blocks: str | None = None,
) -> tuple[LlamaForCausalLM, list[tuple[str, torch.Tensor]]]:
    """A 3-layer random Llama whose every linear weight is exactly its `fmt` blocks (64-dim
    heads, 2 kv heads), with the kernels on and the blocks attached, as the loader does;
    and its checkpoint (HF names). "Q4_1-int8", "Q8_0-int8": on the int8-activation
    kernel. `without_blocks`: a checkpoint tensor left without blocks (float32)."""
    int8 = fmt.endswith("-int8")
    fmt = fmt.removesuffix("-int8")
    config = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 320,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 200, "max_position_embeddings": 512, "tie_word_embeddings": False})
    model = LlamaForCausalLM(config)
    weights, blocks = [], []
    for seed, (name, param) in enumerate(model.named_parameters()):
        if name.endswith("norm.weight"):
            weights.append((name, 1 + 0.1 * torch.randn(param.shape)))
        elif name == "model.embed_tokens.weight" or name == "lm_head.weight":
            weights.append((name, torch.randn(param.shape) * 0.5))
        else:
            for part, rows in _checkpoint_shards(name, param.shape[0], config):
                raw, dense = _blocks(fmt, rows, param.shape[1], seed=seed * 3 + len(weights))
                weights.append((part, dense))
                if part != without_blocks:
                    blocks.append((part, fmt, raw))
    model.load_weights(weights)
    model.use_cpu_kernels()
    attached = model.attach_quantized(blocks, int8)
    if without_blocks is not None:
        return model, weights
    assert attached == 4 * config.num_hidden_layers
    assert model.int8_activation_weights() == (4 * config.num_hidden_layers if int8 else 0)
    return model, weights


def _checkpoint_shards(name: str, rows: int, config: ModelConfig) -> list[tuple[str, int]]:
    """The checkpoint tensors (HF names, rows) that make up one of our fused weights."""
    if ".qkv_proj." in name:
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        return [(name.replace("qkv_proj", p), n) for p, n in (("q_proj", q), ("k_proj", kv),
                                                             ("v_proj", kv))]
    if ".gate_up_proj." in name:
        return [(name.replace("gate_up_proj", p), rows // 2) for p in ("gate_proj", "up_proj")]
    return [(name, rows)]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", [*FORMATS, "Q4_1-int8", "Q8_0-int8"])
def test_fused_layers_match_the_module_path_bit_for_bit(
        kernels: bool, fmt: str, kv_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled layer ops are the same kernels in the same order as the modules'
    calls, so mixed steps (a prompt, a chunk after cached context, decodes), steps of
    decodes only (one `decode_layer` call a layer) with and without a shared prefix's
    cascade, and the K/V they store must be identical either way, over a float32 or a
    bfloat16 pool."""
    monkeypatch.setattr(batched, "MIN_DECODE_CASCADE_KEYS", 1)  # a cascade of 2 requests
    model, _ = _quantized_tiny_llama(fmt)
    int8 = fmt.endswith("-int8")
    layers = list(model.model.layers)
    assert all(layer.fused_weights is not None for layer in layers)
    saved = [layer.fused_weights for layer in layers]
    backend = model.attn_backend
    plans: list[StepPlan] = []
    prepare = backend.prepare

    def recording_prepare(meta: AttentionMetadata) -> StepPlan:
        plans.append(prepare(meta))
        return plans[-1]

    backend.prepare = recording_prepare  # type: ignore[method-assign]
    decode_layer = torch.ops.pagellm.decode_layer
    calls = []

    def counting_decode_layer(*args: object) -> object:
        calls.append(len(plans))
        return decode_layer(*args)

    monkeypatch.setattr(torch.ops.pagellm, "decode_layer", counting_decode_layer)
    results = []
    for fused in (True, False):
        for layer, weights in zip(layers, saved, strict=True):
            layer.fused_weights = weights if fused else None
        plans.clear()
        calls.clear()
        sim = PagedSim(model, num_blocks=64, block_size=16, kv_dtype=kv_dtype)
        assert sim.kv_caches[0].dtype == kv_dtype
        steps = [sim.step([("a", list(range(1, 40)))]),
                 sim.step([("a", [7]), ("b", list(range(3, 70)))]),
                 sim.step([("a", [9]), ("b", [11]), ("c", list(range(5, 30)))]),
                 sim.step([("a", [4]), ("b", [12]), ("c", [6])])]
        for name in ("d", "e"):  # 4 blocks of b's, enough context for a cascade
            sim.share_prefix("b", name, 64)
        steps += [sim.step([("d", [21, 22, 23]), ("e", [31])]),
                  sim.step([("b", [13]), ("d", [24]), ("e", [32])])]
        if not fused:
            assert calls == []
        elif not int8:
            decode_calls = [plan.decode_call for plan in plans]
            # One call a layer in the two decode-only steps (the 4th and 6th plans).
            assert calls == [4] * len(layers) + [6] * len(layers)
        else:
            # Row-invariant attention (int8 activations): decodes through the prefill
            # kernel, in one call a layer where no cascade runs (the 6th step's is a
            # state cascade).
            decode_calls = [plan.decode_call for plan in plans]
            assert calls == [4] * len(layers)
        results.append((steps, [cache.clone() for cache in sim.kv_caches]))
    if not int8:
        assert [call is not None for call in decode_calls] == [False] * 3 + [True, False, True]
        assert decode_calls[3] is not None and decode_calls[3][2] is None
        assert decode_calls[5] is not None and decode_calls[5][2] is not None  # the cascade
    else:
        assert [call is not None for call in decode_calls] == [False] * 3 + [True, False, False]
        # The prefill kernel's rows, with bfloat16 products where the kernels have them.
        assert decode_calls[3] is not None and decode_calls[3][3] is not None
        assert decode_calls[3][4] == torch.ops.pagellm.bf16_products_available()
    (fused_steps, fused_caches), (module_steps, module_caches) = results
    for ours, theirs in zip(fused_steps + fused_caches, module_steps + module_caches,
                            strict=True):
        assert torch.equal(ours, theirs)


def test_decode_layer_refuses_bad_inputs_before_storing_rows(kernels: bool) -> None:
    model, _ = _quantized_tiny_llama("Q4_1")
    layer = model.model.layers[0]
    assert layer.decode_args is not None
    hidden, table = torch.randn(1, 256), torch.zeros(1, 1, dtype=torch.int32)
    lens, cos = torch.ones(1, dtype=torch.int32), torch.ones(1, 32)
    cache = torch.zeros(2, 4, 16, 2, 64)
    with pytest.raises(RuntimeError, match=r"kv_cache must be \[2, N, B, Hkv, D\]"):
        torch.ops.pagellm.decode_layer(hidden, None, cos, cos, cache[0], torch.zeros(1).long(),
                                       table, lens, None, None, False, *layer.decode_args)
    bad_heads = list(layer.decode_args)
    bad_heads[5] = 3  # num_heads, not a multiple of the 2 kv heads
    with pytest.raises(RuntimeError, match="num_heads must be a multiple"):
        torch.ops.pagellm.decode_layer(hidden, None, cos, cos, cache, torch.zeros(1).long(),
                                       table, lens, None, None, False, *bad_heads)
    args = (hidden, None, cos, cos, cache, torch.zeros(1).long(), table, lens)
    rows = torch.tensor([[0], [1], [0]])  # the prefill kernel's starts, lens, contexts
    with pytest.raises(RuntimeError, match="bf16_products is for the prefill kernel"):
        torch.ops.pagellm.decode_layer(*args, None, None, True, *layer.decode_args)
    with pytest.raises(RuntimeError, match="the prefill kernel takes no prefix_blocks"):
        torch.ops.pagellm.decode_layer(*args, torch.zeros(1, dtype=torch.int32), rows, False,
                                       *layer.decode_args)
    for bad in (rows.int(), rows[:2], rows[:, 0], torch.zeros(3, 2).long()[:, :1]):
        with pytest.raises(RuntimeError,
                           match=r"prefill_rows must be contiguous int64 \[3, R\]"):
            torch.ops.pagellm.decode_layer(*args, None, bad, False, *layer.decode_args)
    with pytest.raises(RuntimeError, match="one request per token"):
        torch.ops.pagellm.decode_layer(*args, None, torch.tensor([[0, 1], [1, 1], [0, 0]]),
                                       False, *layer.decode_args)
    if not torch.ops.pagellm.bf16_products_available():
        with pytest.raises(RuntimeError, match="bf16_products needs AVX-512 BF16"):
            torch.ops.pagellm.decode_layer(*args, None, rows, True, *layer.decode_args)
    assert torch.equal(cache, torch.zeros_like(cache))  # refused before any row is stored


def test_int8_activations_say_where_a_layer_stays_float32(
        kernels: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A weight without blocks runs in float32, whose results depend on the batch: with
    int8 activations that can change outputs with caching, so the log says so."""
    with caplog.at_level("WARNING"):
        model, _ = _quantized_tiny_llama("Q4_1-int8", "model.layers.1.mlp.down_proj.weight")
    assert "1 layer weights have no Q4_1 or Q8_0 blocks" in caplog.text
    assert "layers.1.mlp.down_proj" in caplog.text
    assert model.int8_activation_weights() == 11
    caplog.clear()
    with caplog.at_level("WARNING"):
        _quantized_tiny_llama("Q4_1-int8")
    assert "stay float32" not in caplog.text


def test_a_layer_without_every_kernel_is_not_fused(kernels: bool) -> None:
    model, checkpoint = _quantized_tiny_llama("Q4_1")
    first, second, third = model.model.layers
    second.self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(256))
    third.mlp.gate_up_proj.quantized = None
    assert first.use_fused_layer()
    assert not second.use_fused_layer() and second.fused_weights is None
    assert not third.use_fused_layer()
    # Reloading the weights drops the blocks, and with them the fused path.
    second.self_attn.o_proj.bias = None
    model.load_weights(checkpoint)
    assert all(layer.fused_weights is None for layer in model.model.layers)


# Under avx512, an avx512 build is narrower where the CPU has AVX-512 BF16: asked for by
# name, it is built without (see _compile_command).
_NARROWER = {"amx": ["avx512", "avx2"], "avx512": ["avx512", "avx2"]}


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_a_narrower_build_passes_the_kernel_tests(kernels: bool, isa: str) -> None:
    """The kernels are one source for several instruction sets; CI on an AMX or AVX-512
    machine would otherwise never run the builds that CPUs without them get (the AVX-512
    panels where there is no AMX, AVX2 where there is no AVX-512, AVX-512 without
    AVX-512 BF16 and so float32 attention under quantize_activations)."""
    widest = cpu_kernels._instruction_set()[0]
    if isa not in _NARROWER.get(widest, []) or (
            widest == isa and "avx512_bf16" not in cpu_kernels._cpu_flags()):
        pytest.skip(f"this CPU runs no wider build than {isa} anyway (or none)")
    tests = Path(__file__).parent
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-rs", "-p", "no:cacheprovider",
         str(tests / "test_cpu_kernels.py"), str(tests / "test_int8_linear.py"),
         str(tests / "test_attention.py"),
         "-k", "not narrower_build"],
        env={**os.environ, "PAGELLM_CPU_ISA": isa}, capture_output=True, text=True,
        timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "cannot be built" not in done.stdout


def test_many_rows_run_on_amx_where_the_build_has_it(kernels: bool) -> None:
    """Where the CPU has AMX and Linux grants it, the tests above exercise the AMX path
    (not the panels silently): the default build is `amx` and reports it in use."""
    if cpu_kernels._instruction_set()[0] != "amx":
        pytest.skip("this CPU (or PAGELLM_CPU_ISA) has no AMX build")
    release = tuple(int(part) for part in re.findall(r"\d+", os.uname().release)[:2])
    if release < (5, 16):
        pytest.skip(f"Linux {os.uname().release} grants no AMX tile state (5.16 does)")
    assert cpu_kernels.amx_in_use()
    assert cpu_kernels.instruction_set() == "amx"


def test_the_instruction_set_is_the_widest_the_cpu_has(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGELLM_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_kernels.platform, "system", lambda: "Linux")
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    amx = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "amx_tile", "amx_bf16", "avx512_bf16"}
    for flags, expected in [(amx, "amx"), (amx - {"avx512_bf16"}, "avx512"),
                            ({"avx2", "fma", "f16c", "amx_tile", "amx_bf16"}, "avx2")]:
        monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda flags=flags: frozenset(flags))
        assert cpu_kernels._instruction_set() == (expected, None)
    # The weights' scales are float16, which AVX2 builds widen with F16C.
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert cpu_kernels._instruction_set() == (
        "", "this CPU has neither AVX-512 nor AVX2 with FMA and F16C")
    monkeypatch.setenv("PAGELLM_CPU_ISA", "avx512")
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: frozenset(amx))
    assert cpu_kernels._instruction_set() == ("avx512", None)
    monkeypatch.setenv("PAGELLM_CPU_ISA", "amx")
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: frozenset(amx - {"amx_bf16"}))
    isa, reason = cpu_kernels._instruction_set()
    assert isa == "" and reason is not None and "no AMX-BF16" in reason
    assert cpu_kernels.instruction_set().startswith("none (PAGELLM_CPU_ISA=amx")
    # A narrower build turns AMX off by name: it does not follow from -mno-avx512f; a CPU
    # without AMX needs no such option (which GCC before 11 would refuse).
    assert "-mno-amx-tile" in cpu_kernels._compile_command("g++", "avx512")
    # avx512 by name: without AVX-512 BF16 too (the default on such a CPU keeps it).
    monkeypatch.setenv("PAGELLM_CPU_ISA", "avx512")
    assert "-mno-avx512bf16" in cpu_kernels._compile_command("g++", "avx512")
    assert cpu_kernels.instruction_set() == "avx512 without AVX-512 BF16"
    monkeypatch.delenv("PAGELLM_CPU_ISA")
    assert "-mno-avx512bf16" not in cpu_kernels._compile_command("g++", "avx512")
    assert {"-mno-avx512f", "-mno-amx-tile"} <= set(cpu_kernels._compile_command("g++", "avx2"))
    assert not any(part.startswith("-mno-") for part in cpu_kernels._compile_command("g++", "amx"))
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: frozenset(amx - {"amx_tile"}))
    assert cpu_kernels._compile_command("g++", "avx2").count("-mno-amx-tile") == 0


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [9, 40])
def test_extreme_inputs_give_no_nan_past_the_register_tiles(kernels: bool, fmt: str,
                                                             rows: int) -> None:
    """The largest finite floats give no NaN (the AMX path's first bfloat16 piece had
    rounded them to infinity, and x - inf made the row NaN; a product may still overflow
    to infinity, as in float32), an infinite x gives a row with no finite value, and the
    other rows are untouched."""
    blocks, dense = _blocks(fmt, 32, 64, seed=rows)
    packed = qk.pack(qk.FORMATS[fmt], blocks, 64)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)) * 1e-3
    x[0, 5] = 3.3961775e38
    got = qk.quantized_linear(x, packed)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got[1:].double(), x[1:].double() @ dense.double().T,
                               rtol=1e-5, atol=1e-5)
    x[0, 5] = float("inf")
    got = qk.quantized_linear(x, packed)
    assert not torch.isfinite(got[0]).any() and torch.isfinite(got[1:]).all()


def test_an_unknown_instruction_set_request_turns_the_kernels_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGELLM_CPU_ISA", "sse2")
    isa, reason = cpu_kernels._instruction_set()
    assert isa == "" and reason is not None and "PAGELLM_CPU_ISA" in reason


def test_the_build_key_follows_the_sources_bytes_not_their_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fresh clone (CI, a new checkout, another virtualenv) built the kernels again
    for 30 s under a key of its own: the command names the sources by path."""
    first = cpu_kernels._build_key(cpu_kernels._compile_command("g++", "avx2"), "g++")
    copies = []
    for source in cpu_kernels._SOURCES:
        copies.append(tmp_path / source.name)
        copies[-1].write_bytes(source.read_bytes())
    monkeypatch.setattr(cpu_kernels, "_SOURCES", tuple(copies))
    command = cpu_kernels._compile_command("g++", "avx2")
    assert any(str(tmp_path) in part for part in command)
    assert cpu_kernels._build_key(command, "g++") == first
    copies[0].write_bytes(copies[0].read_bytes() + b"\n// changed\n")
    assert cpu_kernels._build_key(command, "g++") != first


def test_the_build_key_follows_the_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """`-march=native` builds for every extension the CPU has: a cache directory shared
    with a machine that lacks one of them must not hand it this build."""
    command = ["g++", "-O3", "-march=native"]
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: frozenset({"avx2", "fma", "bmi2"}))
    first = cpu_kernels._build_key(command, "g++")
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: frozenset({"fma", "bmi2", "avx2"}))
    assert cpu_kernels._build_key(command, "g++") == first
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert cpu_kernels._build_key(command, "g++") != first
    assert cpu_kernels._build_key([*command, "-mno-avx512f"], "g++") != \
        cpu_kernels._build_key(command, "g++")


def _fake_compiler(tmp_path: Path, script: str) -> list[str]:
    """A compiler command that runs `script` (bash) with the -o path as $OUT. Asked for
    its version, it only answers: its script once wrote to a file named `--version` in
    the working directory."""
    compiler = tmp_path / "fake-g++"
    compiler.write_text('#!/bin/bash\n[ "$1" = --version ] && echo "fake-g++ 1" && exit 0\n'
                        f'OUT="${{@: -1}}"\n{script}\n')
    compiler.chmod(0o755)
    return [str(compiler)]


def test_a_damaged_library_is_built_again_not_loaded(tmp_path: Path) -> None:
    """Loading a truncated library killed every start with SIGBUS and no message: the
    library is checked against the digest written with it."""
    command = _fake_compiler(tmp_path, 'printf "a whole library" > "$OUT"')
    directory = tmp_path / "kernels" / "cpu-key"
    library, failed = directory / "libpagellm_cpu_kernels.so", directory / "unsupported.txt"
    assert cpu_kernels._compile(command, directory, library, failed)
    assert library.read_text() == "a whole library" and cpu_kernels._intact(library)
    library.write_text("a whole lib")  # truncated
    assert not cpu_kernels._intact(library)
    assert cpu_kernels._compile(command, directory, library, failed)
    assert cpu_kernels._intact(library)
    assert sorted(p.name for p in directory.iterdir()) == [
        "libpagellm_cpu_kernels.so", "libpagellm_cpu_kernels.so.sha256"]


@pytest.mark.parametrize("stderr, recorded", [
    ("fused_ops.cpp:1: error: 'foo' was not declared", True),
    ("ld: final link failed: No space left on device", False),
    ("g++: fatal error: Killed signal terminated program cc1plus", False),
    ("g++: fatal error: Terminated signal terminated program cc1plus", False),
    ("collect2: fatal error: ld terminated with signal 9 [Killed]", False),
])
def test_only_a_real_compile_error_turns_the_kernels_off_for_good(
        tmp_path: Path, stderr: str, recorded: bool) -> None:
    """A build that ran out of disk or memory, or was killed, is tried again at the next
    start; one failure of any kind used to turn the kernels off for good."""
    command = _fake_compiler(tmp_path, f'echo "{stderr}" >&2; exit 1')
    directory = tmp_path / "kernels" / "cpu-key"
    library, failed = directory / "libpagellm_cpu_kernels.so", directory / "unsupported.txt"
    assert not cpu_kernels._compile(command, directory, library, failed)
    assert failed.is_file() is recorded
    assert not library.exists()


def test_an_unwritable_kernel_directory_falls_back_to_torch_ops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A read-only cache refused to start; the model now runs on torch ops, saying why."""
    def unwritable(*args: object) -> bool:
        raise PermissionError(13, "Permission denied", str(tmp_path / "kernels"))

    monkeypatch.setattr(cpu_kernels, "_compile", unwritable)
    monkeypatch.setattr(cpu_kernels, "_instruction_set", lambda: ("avx2", None))
    monkeypatch.setenv("CXX", "g++")
    assert cpu_kernels._build_and_load(tmp_path / "empty-cache" / "kernels") is False
    assert "cannot build them into" in caplog.text and "PAGELLM_CACHE_DIR" in caplog.text


def test_built_kernels_load_from_a_cache_that_cannot_be_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache warmed as root and read by another user (or mounted read-only) must load
    its kernels: taking the build lock first (it opens a file there) turned them off."""
    monkeypatch.setattr(cpu_kernels, "_instruction_set", lambda: ("avx2", None))
    monkeypatch.setenv("CXX", str(tmp_path / "fake-g++"))
    fake = _fake_compiler(tmp_path, 'printf "built" > "$OUT"')
    command = cpu_kernels._compile_command(str(tmp_path / "fake-g++"), "avx2")
    root = tmp_path / "cache" / "kernels"
    directory = root / f"cpu-{cpu_kernels._build_key(command, str(tmp_path / 'fake-g++'))}"
    library = directory / "libpagellm_cpu_kernels.so"
    assert cpu_kernels._compile(fake, directory, library, directory / "unsupported.txt")

    def unwritable(*args: object) -> object:
        raise PermissionError(13, "Permission denied", str(root / "locks"))

    loaded: list[Path] = []
    monkeypatch.setattr(cpu_kernels.file_lock, "exclusive", unwritable)
    monkeypatch.setattr(cpu_kernels, "_load", lambda path: loaded.append(path) or True)
    assert cpu_kernels._build_and_load(root) is True
    assert loaded == [library]


def test_an_interrupted_build_stops_the_compiler_and_its_children(tmp_path: Path) -> None:
    """Ctrl-C during `pagellm generate`'s first start killed the compiler driver alone;
    the compiler it had started ran on for a minute."""
    import signal
    import threading

    pids = tmp_path / "pids"
    command = _fake_compiler(tmp_path, f'sleep 120 & echo $! >> {pids}\nwait')
    directory = tmp_path / "kernels" / "cpu-key"
    library = directory / "libpagellm_cpu_kernels.so"
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        cpu_kernels._compile(command, directory, library, directory / "unsupported.txt")
    timer.join()
    child = int(pids.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and "Z" not in Path(
            f"/proc/{child}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the compiler's child still runs"
        time.sleep(0.05)
    assert not list(directory.glob(f".{library.name}.*")), "a temporary library was left"
