"""Rotary position embeddings (RoPE), in the "rotate half" layout of Hugging Face checkpoints.

Supported frequency schemes: plain RoPE, `linear` (positions divided by a factor) and
`llama3` (low frequencies divided by a factor, high ones kept, a smooth ramp between).
cos/sin are computed per step from the absolute positions the runner passes, not taken from
a table: that is a [T, D] elementwise product, costs less than one layer's matmul, and needs
no memory sized by max_position_embeddings (128k for Llama 3.1).

The inverse frequencies stay float32 whatever the model dtype, as in the reference, because
bf16 frequencies lose whole positions at long context.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from pagellm.model.errors import UnsupportedArchitectureError


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: Mapping[str, Any] | None
) -> torch.Tensor:
    """The [head_dim // 2] float32 inverse frequencies for a rope scheme (on the CPU).

    The device is explicit so that building the model under `torch.device("meta")`, as the
    loader does, still yields real frequencies.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    raise UnsupportedArchitectureError(f"rope type {rope_type!r} is not supported")


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1's context extension: scale wavelengths longer than the original context.

    Wavelengths shorter than original_context / high_freq_factor carry local order and are
    kept; those longer than original_context / low_freq_factor are divided by `factor`; the
    band between is linearly interpolated in frequency space.
    """
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    long_wave = wavelength > original / low
    short_wave = wavelength < original / high
    scaled = torch.where(long_wave, inv_freq / factor, inv_freq)
    ramp = (original / wavelength - low) / (high - low)
    blended = (1 - ramp) * scaled / factor + ramp * scaled
    return torch.where(~long_wave & ~short_wave, blended, scaled)


class RotaryEmbedding:
    """Computes cos/sin for a batch of positions and rotates query/key heads with them."""

    def __init__(self, head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> None:
        self.head_dim = head_dim
        self._inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [T, head_dim] for absolute `positions[T]`, cast to `dtype`."""
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq.to(positions.device)
            self._on_device[positions.device] = inv_freq
        freqs = positions.float()[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x[T, heads, head_dim] by per-token cos/sin[T, head_dim] (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
