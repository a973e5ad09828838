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
    `quantized`, when the loader attaches the checkpoint's own quantized blocks, serves
    every matmul (see quant_kernels), except gated blocks: those serve their GatedMLP.
    Otherwise `pack_for_cpu` replaces the weight by its oneDNN-packed form (see
    cpu_matmul): the dense copy is dropped rather than kept beside it, so packing costs no
    memory.
    """

    packed = False
    quantized: quant_kernels.QuantizedWeight | None = None

    def reset_parameters(self) -> None:
        return None

    def pack_for_cpu(self) -> None:
        """Switch to the oneDNN packed weight where it serves and no quantized blocks do;
        call after loading (and after attaching blocks)."""
        if self.packed or self.quantized is not None or not cpu_matmul.serves(self.weight):
            return
        packed = cpu_matmul.pack(self.weight)
        del self.weight
        self.register_buffer("weight", packed, persistent=False)
        self.packed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quantized = self.quantized
        if quantized is not None and not quantized.gated and x.dim() == 2:
            out = quant_kernels.quantized_linear(x, quantized)
            return out if self.bias is None else out + self.bias
        if self.packed:
            return cpu_matmul.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding whose table starts uninitialised (see Linear)."""

    def reset_parameters(self) -> None:
        return None


def _fusable(x: torch.Tensor) -> bool:
    """Whether the compiled fused ops (cpu_kernels) take this tensor."""
    return x.device.type == "cpu" and x.dtype == torch.float32


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned per-channel scale.

    `fused` (set by the loader once the compiled CPU kernels are loaded) runs each call as
    one op instead of seven small ones (see csrc/fused_ops.cpp)."""

    fused = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and _fusable(x):
            out: torch.Tensor = torch.ops.pagellm.rms_norm(
                x.reshape(-1, x.shape[-1]).contiguous(), self.weight, self.eps)
            return out.view(x.shape)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): a pre-norm block's residual add and the next
        norm, in one op when fused."""
        if self.fused and _fusable(x) and x.dim() == 2:
            normed, total = torch.ops.pagellm.add_rms_norm(
                x.contiguous(), residual.contiguous(), self.weight, self.eps)
            return normed, total
        total = residual + x
        return self(total), total


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul.

    One [2*I, H] weight instead of two [I, H] ones halves the kernel launches per layer, which
    is a visible share of a small model's step time on CPU. The loader fills the two halves
    from the checkpoint's separate gate_proj/up_proj tensors.
    """

    fused = False  # silu(gate) * up as one compiled op (see RMSNorm.fused)

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def use_gated_kernel(self) -> bool:
        """Put gate_up_proj's quantized blocks in the gated kernel's (gate, up) pairs, when
        it has blocks, no bias (it lands between the product and the silu) and halves of
        whole tiles; returns whether they are. One kernel call then computes the product
        and silu(gate) * up together. The layer keeps its float32 weight for other inputs.

        Why: silu_mul after the matmul reads the [rows, 2I] product back and writes
        [rows, I]; in the epilogue the product never leaves the registers (a no-sharing run,
        32 x 1,056 prompt tokens: silu_mul took 0.67 of 31 s)."""
        quantized = self.gate_up_proj.quantized
        if (quantized is None or self.gate_up_proj.bias is not None
                or self.intermediate_size % 16):
            return False
        if not quantized.gated:
            self.gate_up_proj.quantized = quant_kernels.gate_up_pairs(quantized)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quantized = self.gate_up_proj.quantized
        if quantized is not None and quantized.gated and x.dim() == 2:
            activated = quant_kernels.quantized_linear(x, quantized)
        else:
            gate_up = self.gate_up_proj(x)
            if (self.fused and _fusable(gate_up) and gate_up.dim() == 2
                    and self.intermediate_size % 16 == 0):
                activated = torch.ops.pagellm.silu_mul(gate_up.contiguous())
            else:
                gate, up = gate_up.split(self.intermediate_size, dim=-1)
                activated = F.silu(gate) * up
        out: torch.Tensor = self.down_proj(activated)
        return out
