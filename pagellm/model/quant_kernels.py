"""Matrix multiplies that read a GGUF checkpoint's weight blocks directly (CPU).

Why: a decode step multiplies a few rows by every weight of the model, so its speed is
set by how many weight bytes stream from memory. SmolLM2-135M's linear layers are 425 MB
as float32 but 66 MB as Q4_1 blocks (5 bits per weight as packed here), and its tied
vocabulary head 113 MB but 30 MB as Q8_0 (8.5 bits). Measured on this project's 2-core AVX-512
machine, with 30 layers' weights streamed from memory as in a real step, against
oneDNN's float32 GEMM: 1 row 13.9 -> 2.9 ms, 8 rows 16.1 -> 6.8 ms, 32 rows 26.5 -> 18.2
ms, 128 rows 70.1 -> 64.6 ms, 512 rows 268 -> 264 ms; the head, 1 row 1.8 -> 0.5 ms, 32
rows 5.4 -> 4.8 ms. Past its register tiles (8 rows with AVX-512; with AVX2 6 for Q4_1
and 4 for Q8_0) the kernel unpacks each pair of tiles into float32 once
and multiplies every row by it, like a GEMM, while the next pair's blocks are fetched
(see csrc/quant_linear.cpp). A layer with blocks uses them for every matmul: oneDNN is
ahead only from 1,024 rows, by 3% (510 vs 526 ms), more than a 512-token step holds
(the CPU's default budget is 256), and without its packed float32 copies the default model's
process holds 2,040 instead of 2,481 MB after loading.

Exactness: for many rows the kernels rebuild each weight with the GGUF reader's own
float32 roundings (Q4_1 `(scale * code) + min`, Q8_0 `scale * code`; the loader checks
sampled rows), so they multiply by exactly the float32 weights the model was loaded with;
only the summation order differs from another GEMM's, as between any two GEMM libraries.
For a few rows (a decode step of up to 6 requests with AVX2, 8 with AVX-512) Q4_1 is
factored per block, scale * sum(x * code) + min * sum(x), never rebuilding a weight:
equal in exact arithmetic, rounded differently (tested against float64). Per decode step, alternating processes: one request
10.6-11.2 -> 9.4-10.0 ms, three 18.3-19.9 -> 15.8-17.6 ms; 30 layers' matmuls at 3 rows
10.2 -> 7.3 ms.

Where the CPU has AMX's bfloat16 tiles, the many-row path runs on them instead of the
panels, in the same arithmetic class (exact products, float32 sums; csrc/amx_matmul.h):
shared-prefix 3.6 -> 3.0 s, no-sharing 32.3 -> 24.7 s on this project's Xeon.

The kernels are C++ (csrc/quant_linear.cpp), built and loaded by cpu_kernels; where they
cannot run, nothing is attached and every matmul stays on the float32 path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per GGUF block, along the input dimension
_LANES = 16  # output rows per kernel tile (16 float32 lanes: csrc/simd.h)


@dataclass(frozen=True)
class BlockFormat:
    """A GGUF block format the kernels read: bytes per block of 32 weights."""

    name: str
    block_bytes: int


FORMATS: dict[str, BlockFormat] = {
    "Q4_1": BlockFormat("Q4_1", 20),  # float16 scale, float16 min, 16 bytes of nibbles
    "Q8_0": BlockFormat("Q8_0", 34),  # float16 scale, 32 int8 codes
}


@dataclass(frozen=True)
class QuantizedWeight:
    """A [out, in] weight in a kernel's tiled layout (see csrc/quant_linear.cpp)."""

    format: BlockFormat
    # tiles = the weight's rows / 16 (when gated, twice out_features / 16)
    # The GGUF's own float16 (the kernels widen them exactly as they load them: see
    # csrc/quant_linear.cpp)
    scales: torch.Tensor  # float16 [tiles, in / 32, 16]
    codes: torch.Tensor  # Q4_1: uint8 [tiles, in / 32, 16, 16]; Q8_0: int8 [.., 32, 16]
    mins: torch.Tensor | None = None  # Q4_1: float16 like scales
    # A gated MLP's gate and up halves, tiles in (gate, up) pairs: the kernel returns
    # silu(gate) * up [rows, out / 2] (see gate_up_pairs).
    gated: bool = False

    @property
    def out_features(self) -> int:
        """Outputs of the kernel: half the tiles' rows when gated."""
        rows = int(self.scales.shape[0]) * _LANES
        return rows // 2 if self.gated else rows

    @property
    def in_features(self) -> int:
        return int(self.scales.shape[1]) * BLOCK

    @property
    def int8_activations(self) -> bool:
        """Whether the codes are in the layout of the int8-activation kernel (see
        int8_activation_layout): [tiles, blocks, groups, 64] where the float32 kernels'
        own is [tiles, blocks, inputs, 16]."""
        return self.codes.dim() == 4 and int(self.codes.shape[3]) == 64

    def op_args(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(scales, mins, codes) as the compiled layer ops take a weight: Q4_1 when mins
        is given, else Q8_0."""
        return self.scales, self.mins, self.codes


def packable(out_features: int, in_features: int) -> bool:
    """Whether a weight of this shape fits the kernels' tiles."""
    return out_features % _LANES == 0 and in_features % BLOCK == 0


def _fields(fmt: BlockFormat, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """Raw blocks [rows, in / 32 * bytes] as [rows, in / 32, bytes], checked."""
    expected = (blocks.shape[0], in_features // BLOCK * fmt.block_bytes)
    if in_features % BLOCK or blocks.dtype != torch.uint8 or tuple(blocks.shape) != expected:
        raise ValueError(f"{fmt.name} blocks of {in_features} inputs must be uint8 {expected}, "
                         f"got {blocks.dtype} {tuple(blocks.shape)}")
    return blocks.reshape(blocks.shape[0], in_features // BLOCK, fmt.block_bytes)


def _half(field: torch.Tensor) -> torch.Tensor:
    """Two-byte little-endian float16 fields [..., 2] as float32 [...]."""
    return field.contiguous().view(torch.float16).float().squeeze(-1)


def dequantize(fmt: BlockFormat, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """Float32 weights [rows, in] of raw blocks, rounded as the GGUF reader rounds them."""
    raw = _fields(fmt, blocks, in_features)
    scale = _half(raw[..., 0:2])[..., None]
    if fmt.name == "Q4_1":
        packed = raw[..., 4:].long()
        codes = torch.cat([packed & 0xF, packed >> 4], dim=-1).float()
        weights = scale * codes + _half(raw[..., 2:4])[..., None]
    else:
        weights = scale * raw[..., 2:].contiguous().view(torch.int8).float()
    return weights.reshape(blocks.shape[0], in_features)


def pack(fmt: BlockFormat, blocks: torch.Tensor, in_features: int) -> QuantizedWeight:
    """The kernel's layout for raw blocks [out, in / 32 * bytes] (GGUF's byte order)."""
    out_features = blocks.shape[0]
    if not packable(out_features, in_features):
        raise ValueError(f"a [{out_features}, {in_features}] weight does not fit the tiles")
    raw = _fields(fmt, blocks, in_features)
    tiled = raw.reshape(out_features // _LANES, _LANES, in_features // BLOCK, fmt.block_bytes)

    def per_lane(field: torch.Tensor) -> torch.Tensor:  # [t, lanes, b, 2] -> [t, b, lanes]
        return field.contiguous().view(torch.float16).squeeze(-1).transpose(1, 2).contiguous()

    if fmt.name == "Q4_1":
        return QuantizedWeight(fmt, per_lane(tiled[..., 0:2]),
                               tiled[..., 4:].permute(0, 2, 3, 1).contiguous(),
                               per_lane(tiled[..., 2:4]))
    codes = tiled[..., 2:].contiguous().view(torch.int8)
    return QuantizedWeight(fmt, per_lane(tiled[..., 0:2]), codes.permute(0, 2, 3, 1).contiguous())


def gate_up_pairs(weight: QuantizedWeight) -> QuantizedWeight:
    """A fused [gate; up] weight with its tiles reordered (gate 0, up 0, gate 1, up 1, ...)
    for the gated kernel: each pair of tiles is one panel of the kernel, whose epilogue
    writes silu(gate) * up straight from its accumulators."""
    tiles = weight.scales.shape[0]
    if weight.gated or tiles % 2:
        raise ValueError(f"a gated weight needs an even number of unpaired tiles, got {tiles}")
    order = torch.arange(tiles).view(2, tiles // 2).t().reshape(-1)

    def paired(field: torch.Tensor | None) -> torch.Tensor | None:
        return None if field is None else field[order].contiguous()

    codes, scales = paired(weight.codes), paired(weight.scales)
    assert codes is not None and scales is not None
    return QuantizedWeight(weight.format, scales, codes, paired(weight.mins), gated=True)


def int8_activation_layout(weight: QuantizedWeight) -> QuantizedWeight:
    """A weight's codes rearranged for the kernel that quantizes the activations to int8
    (csrc/int8_linear.cpp): byte j of lane n (Q4_1: the nibbles of inputs j and j + 16;
    Q8_0: input j) moves to group j // 4, byte 4n + j % 4, so each lane's 4 consecutive
    inputs are one 32-bit word, as the integer dot-product instructions read them. The
    codes are the same bytes."""
    if weight.int8_activations:
        raise ValueError("this weight is in the int8 layout already")
    tiles, blocks, inputs = (int(n) for n in weight.codes.shape[:3])
    codes = (weight.codes.view(tiles, blocks, inputs // 4, 4, _LANES).transpose(3, 4)
             .reshape(tiles, blocks, inputs // 4, 4 * _LANES).contiguous())
    return QuantizedWeight(weight.format, weight.scales, codes, weight.mins, weight.gated)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [rows, in] @ weight.T through its kernel (once cpu_kernels.load succeeded); for a
    gated weight, silu(gate) * up of that product."""
    x = x.contiguous()
    out: torch.Tensor
    if weight.int8_activations and weight.mins is not None:
        out = torch.ops.pagellm.q4_1_int8_linear(x, weight.scales, weight.mins, weight.codes,
                                                 weight.gated)
    elif weight.int8_activations:
        out = torch.ops.pagellm.q8_0_int8_linear(x, weight.scales, weight.codes, weight.gated)
    elif weight.mins is not None:
        out = torch.ops.pagellm.q4_1_linear(x, weight.scales, weight.mins, weight.codes,
                                            weight.gated)
    else:
        out = torch.ops.pagellm.q8_0_linear(x, weight.scales, weight.codes, weight.gated)
    return out
