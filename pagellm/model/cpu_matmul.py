"""Linear-layer matrix multiplies on CPU through oneDNN instead of torch's default (MKL).

Why: on the AMD EPYC machines this project runs on, MKL's float32 GEMM is far slower than
oneDNN's (which uses AVX-512 where the CPU has it). Measured on SmolLM2-135M's layer
shapes, 30 layers, 2 threads: 4 rows 36 -> 11 ms, 32 rows 56 -> 22 ms, a 1,024-token
prefill 1,042 -> 445 ms with weights packed once into oneDNN's blocked layout; the tied
49,152 x 576 lm_head (packed as a copy, its table is also the embedding) 20 -> 4.6 ms for
32 rows. Results agree with MKL's to float32 rounding (another summation order).

Packing happens once, after the weights are loaded; a packed weight is an opaque
`torch._mkldnn` tensor usable only here. Where oneDNN is not built in, or for devices and
dtypes it does not serve, everything stays on `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows per call the packed layout is tuned for: a decode batch. Any row count works with it
# (a 1,024-token prefill measured the same as with a layout packed for 1,024 rows).
PACK_BATCH_HINT = 32

_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear kernels."""
    built: bool = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    return built and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def serves(weight: torch.Tensor) -> bool:
    """Whether a dense weight can take the oneDNN path. bfloat16 only where oneDNN runs it
    on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): elsewhere packing raised at load."""
    if weight.device.type != "cpu" or weight.dtype not in _DTYPES or not onednn_available():
        return False
    return weight.dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] in oneDNN's blocked layout, for `linear` (see `serves`)."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(
        weight.detach(), PACK_BATCH_HINT
    )
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias, with `weight` packed (from `pack`) or dense.

    A dense weight goes through oneDNN when it `serves`, else through F.linear."""
    if weight.is_mkldnn or serves(weight):
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), weight, bias, "none", [], ""
        )
        return out
    return F.linear(x, weight, bias)
