"""Building blocks shared by the decoder architectures: RMSNorm, the gated SiLU MLP, and
Linear/Embedding layers that skip random initialisation.

The numerics copy the reference implementation's order of operations on purpose (normalise
in float32, cast back, then scale), so float32 logits match transformers to ~1e-5 and bf16
runs round the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.model import cpu_matmul, quant_kernels


class Linear(nn.Linear):
    """nn.Linear whose weights start uninitialised and can be packed for oneDNN.

    Every weight is overwritten from a checkpoint, and random init (or building on the meta
    device to avoid it, whose first use costs ~2 s of torch start-up) is pure start-up time.
    `pack_for_cpu` replaces the weight by its oneDNN-packed form (see cpu_matmul): the
    dense copy is dropped rather than kept beside it, so packing costs no memory.
    `quantized`, when the loader attaches the checkpoint's own quantized blocks, serves
    matmuls of fewer rows than its format's `max_rows` (decode steps) (see quant_kernels).
    """

    packed = False
    quantized: quant_kernels.QuantizedWeight | None = None

    def reset_parameters(self) -> None:
        return None

    def pack_for_cpu(self) -> None:
        """Switch to the oneDNN packed weight where it serves; call after loading."""
        if self.packed or not cpu_matmul.serves(self.weight):
            return
        packed = cpu_matmul.pack(self.weight)
        del self.weight
        self.register_buffer("weight", packed, persistent=False)
        self.packed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quantized = self.quantized
        if quantized is not None and x.dim() == 2 and x.shape[0] < quantized.format.max_rows:
            out = quant_kernels.quantized_linear(x, quantized)
            return out if self.bias is None else out + self.bias
        if self.packed:
            return cpu_matmul.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding whose table starts uninitialised (see Linear)."""

    def reset_parameters(self) -> None:
        return None


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned per-channel scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul.

    One [2*I, H] weight instead of two [I, H] ones halves the kernel launches per layer, which
    is a visible share of a small model's step time on CPU. The loader fills the two halves
    from the checkpoint's separate gate_proj/up_proj tensors.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out
