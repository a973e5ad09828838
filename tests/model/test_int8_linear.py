"""The int8-activation kernels for Q4_1 and Q8_0 (csrc/int8_linear.cpp,
EngineConfig.quantize_activations): their arithmetic against a float64 model of it, their
error against the float32 product, rows that never depend on their batch, the gated
epilogue, and the layouts' refusals."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cpu_kernels import _blocks

from pagellm.cache_dir import resolve_cache_dir
from pagellm.model import cpu_kernels
from pagellm.model import quant_kernels as qk

FORMATS = sorted(qk.FORMATS)


@pytest.fixture(scope="module")
def kernels() -> bool:
    if not cpu_kernels.load(resolve_cache_dir() / "kernels"):
        pytest.skip("the quantized kernels cannot be built or run on this machine")
    return True


def _weight(fmt: str, out: int, inp: int,
            seed: int) -> tuple[qk.QuantizedWeight, torch.Tensor]:
    raw, dense = _blocks(fmt, out, inp, seed=seed)
    return qk.int8_activation_layout(qk.pack(qk.FORMATS[fmt], raw, inp)), dense


def _model_of_the_kernel(x: torch.Tensor, weight: qk.QuantizedWeight) -> torch.Tensor:
    """What the kernel computes, in float64: each row's block of 32 inputs rounded to
    int8 at 127 / (its largest magnitude), the block's integer dot product with the
    codes times the weight's scale and the row's (largest / 127), plus (Q4_1) the
    weight's min times the block's float32 sum of inputs."""
    rows, inp = x.shape
    blocks = inp // 32
    xb = x.view(rows, blocks, 32)
    amax = xb.abs().amax(-1)
    # (127 / amax in torch is 127 * (1 / amax), which rounds twice.)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).double()
    scale = (amax / 127.0).double()
    sums = xb.sum(-1).double()
    tiles, groups = weight.scales.shape[0], weight.codes.shape[2]
    # The int8 layout back to codes [tiles, blocks, 16 lanes, 32 inputs].
    packed = weight.codes.view(tiles, blocks, groups, 16, 4).permute(0, 1, 3, 2, 4).long()
    if weight.mins is None:
        codes = packed.reshape(tiles, blocks, 16, 32)
    else:
        codes = torch.cat([(packed & 0xF).reshape(tiles, blocks, 16, 16),
                           (packed >> 4).reshape(tiles, blocks, 16, 16)], -1)
    dots = torch.einsum("rbi,tbni->rtbn", q, codes.double())  # exact integers
    out = (dots * weight.scales.double()[None] * scale[:, None, :, None]).sum(2)
    if weight.mins is not None:
        out += (weight.mins.double()[None] * sums[:, None, :, None]).sum(2)
    return out.reshape(rows, tiles * 16)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 12, 13, 47, 48, 49, 100, 600])
@pytest.mark.parametrize("out", [96, 48])
def test_kernel_computes_its_model_at_every_row_count(kernels: bool, fmt: str, rows: int,
                                                      out: int) -> None:
    """Passes of up to 6 rows (2 with AVX2) against pairs of tiles and, at 48 outputs,
    a last odd tile; tasks of 48 rows (16 with AVX2). The float32 steps add ~1e-7
    relative error per block to the exact value of the kernel's own formula."""
    weight, _ = _weight(fmt, out, 576, seed=rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    got = qk.quantized_linear(x, weight)
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    expected = _model_of_the_kernel(x, weight)
    assert (got.double() - expected).abs().max().item() < 2e-5


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("inp", [32, 576, 1536])
def test_error_against_float32_is_the_inputs_rounding(kernels: bool, fmt: str, inp: int) -> None:
    """Rounding an input to int8 moves it at most half a step, (largest / 127) / 2, in its
    block, so |y - x W^T| is at most the sum over inputs of |weight| x half a step."""
    weight, dense = _weight(fmt, 64, inp, seed=inp)
    x = torch.randn(33, inp, generator=torch.Generator().manual_seed(inp))
    x[3, :32] *= 100  # one block of large inputs: its step is large, the others' are not
    got = qk.quantized_linear(x, weight).double()
    exact = x.double() @ dense.double().T
    step = x.view(33, -1, 32).abs().amax(-1).double() / 127
    bound = (dense.double().abs().view(64, -1, 32).sum(-1) @ (step / 2).T).T
    assert ((got - exact).abs() <= bound * (1 + 1e-4) + 1e-5).all()
    # Not merely inside the bound: far closer to the float32 product than a zero output.
    assert (got - exact).abs().mean() < 0.05 * exact.abs().mean()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gated", [False, True])
def test_a_row_never_depends_on_its_batch(kernels: bool, fmt: str, gated: bool) -> None:
    """A row's result is the same bits alone, in any pass, task or position: the integer
    sums are exact and the float32 steps per block are the same in every pass. (The
    float32 kernels promise this only past their register tiles.) So caching, which
    computes a token in batches of other sizes, never changes a result."""
    raw, _ = _blocks(fmt, 2 * 96, 1536, seed=7)
    packed = qk.pack(qk.FORMATS[fmt], raw, 1536)
    weight = qk.int8_activation_layout(qk.gate_up_pairs(packed) if gated else packed)
    x = torch.randn(300, 1536, generator=torch.Generator().manual_seed(7))
    full = qk.quantized_linear(x, weight)
    for start, rows in [(0, 1), (5, 1), (299, 1), (0, 2), (3, 5), (7, 13), (40, 17),
                        (100, 49), (0, 97), (120, 180)]:
        part = qk.quantized_linear(x[start:start + rows], weight)
        assert torch.equal(part, full[start:start + rows]), (start, rows)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 6, 7, 50])
def test_gated_kernel_is_silu_mul_of_the_product_bit_for_bit(kernels: bool, fmt: str,
                                                            rows: int) -> None:
    raw, _ = _blocks(fmt, 2 * 96, 64, seed=rows)
    packed = qk.pack(qk.FORMATS[fmt], raw, 64)
    plain = qk.int8_activation_layout(packed)
    gated = qk.int8_activation_layout(qk.gate_up_pairs(packed))
    assert gated.gated and gated.int8_activations and gated.out_features == 96
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    expected = torch.ops.pagellm.silu_mul(qk.quantized_linear(x, plain))
    assert torch.equal(qk.quantized_linear(x, gated), expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_layout_holds_the_same_codes(kernels: bool, fmt: str) -> None:
    """A one-hot row reads back each weight (code times scale, plus Q4_1's min): the
    lone input is 127 (scale 1/127 of it), its block's sum is itself."""
    weight, dense = _weight(fmt, 32, 64, seed=3)
    x = torch.zeros(64, 64)
    x[torch.arange(64), torch.arange(64)] = 127.0
    got = qk.quantized_linear(x, weight)
    assert torch.allclose(got, 127.0 * dense.T, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_and_non_finite_rows(kernels: bool, fmt: str) -> None:
    """A row of zeros gives zeros; a NaN or an infinity spoils its own row only."""
    weight, _ = _weight(fmt, 32, 64, seed=4)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    x[0] = 0
    x[1, 5] = math.nan
    x[2, 40] = math.inf
    got = qk.quantized_linear(x, weight)
    assert torch.equal(got[0], torch.zeros(32))
    assert not got[1].isfinite().any() and not got[2].isfinite().any()
    assert torch.equal(got[3], qk.quantized_linear(x[3:].contiguous(), weight)[0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_layouts_are_refused_by_the_other_kernel(kernels: bool, fmt: str) -> None:
    raw, _ = _blocks(fmt, 32, 64)
    plain = qk.pack(qk.FORMATS[fmt], raw, 64)
    int8 = qk.int8_activation_layout(plain)
    assert int8.int8_activations and not plain.int8_activations
    assert int8.codes.shape == (2, 2, 4 if fmt == "Q4_1" else 8, 64)
    assert torch.equal(int8.codes.flatten().sort().values, plain.codes.flatten().sort().values)
    x = torch.randn(2, 64)
    name = fmt.lower()
    with pytest.raises(RuntimeError, match="int8 layout"):
        getattr(torch.ops.pagellm, f"{name}_int8_linear")(x, *plain.op_args()[::2]
                                                          if fmt == "Q8_0" else plain.op_args(),
                                                          False)
    with pytest.raises(RuntimeError, match=f"{name}_int8_linear"):
        getattr(torch.ops.pagellm, f"{name}_linear")(x, *int8.op_args()[::2]
                                                     if fmt == "Q8_0" else int8.op_args(), False)
    with pytest.raises(RuntimeError, match="inputs"):
        qk.quantized_linear(torch.randn(2, 32), int8)
    with pytest.raises(RuntimeError, match="float32"):
        qk.quantized_linear(x.double(), int8)
    with pytest.raises(ValueError, match="int8 layout already"):
        qk.int8_activation_layout(int8)
    assert qk.quantized_linear(torch.zeros(0, 64), int8).shape == (0, 32)


_CROSS_ISA = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_int8_linear import _cross_isa_outputs
from pagellm.cache_dir import resolve_cache_dir
from pagellm.model import cpu_kernels
assert cpu_kernels.load(resolve_cache_dir() / "kernels")
torch.save(_cross_isa_outputs(), {out!r})
"""


def _cross_isa_outputs() -> list[torch.Tensor]:
    outputs = []
    for fmt in FORMATS:
        for rows in (1, 5, 50):
            weight, _ = _weight(fmt, 96, 576, seed=rows)
            x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
            outputs.append(qk.quantized_linear(x, weight))
    return outputs


@pytest.mark.slow
def test_the_avx2_build_gives_the_same_bits(kernels: bool, tmp_path: Path) -> None:
    """The integer sums are the same whichever instructions make them (VNNI, byte
    multiply-adds in 512 or 256 bits) and the float32 steps after them too, so a row's
    result does not depend on the machine's instruction set either."""
    if cpu_kernels._instruction_set()[0] not in ("avx512", "amx"):
        pytest.skip("this CPU runs the AVX2 build anyway")
    out = tmp_path / "avx2.pt"
    script = _CROSS_ISA.format(tests=str(Path(__file__).parent), out=str(out))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PAGELLM_CPU_ISA": "avx2"}, timeout=900,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for ours, theirs in zip(_cross_isa_outputs(), torch.load(out), strict=True):
        assert torch.equal(ours, theirs)
