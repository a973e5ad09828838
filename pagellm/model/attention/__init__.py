"""Paged attention backends: write the step's new K/V into the block pool, then attend.

A backend is chosen by name at start-up and shared by every layer. Each step the model asks
it once for a *plan* (`prepare`): whatever per-step index tensors and masks the backend
needs, built once from the AttentionMetadata and reused by all layers, since they only
depend on the batch's shape. Then each layer calls `forward`.

- `base.py`: what every backend shares (spec, plans, the interface, the KV layout, masks);
- `reference.py`: `torch_ref`, one plain SDPA call per request, the one others are
  tested against;
- `batched.py`: `torch_batched`, the default: padded groups, the shared-prefix cascade,
  the compiled CPU kernels, and the fixed-shape decode of a CUDA graph.
"""

from __future__ import annotations

from pagellm.model.attention.base import (
    AttentionBackend,
    AttentionSpec,
    GraphDecodePlan,
    StepPlan,
    allocate_kv_caches,
    write_kv_cache,
)
from pagellm.model.attention.batched import TorchBatchedBackend
from pagellm.model.attention.reference import TorchRefBackend

__all__ = [
    "ATTENTION_BACKENDS",
    "DEFAULT_ATTENTION_BACKEND",
    "AttentionBackend",
    "AttentionSpec",
    "GraphDecodePlan",
    "StepPlan",
    "TorchBatchedBackend",
    "TorchRefBackend",
    "allocate_kv_caches",
    "get_attention_backend",
    "write_kv_cache",
]

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchRefBackend.name: TorchRefBackend,
    TorchBatchedBackend.name: TorchBatchedBackend,
}

DEFAULT_ATTENTION_BACKEND = TorchBatchedBackend.name


def get_attention_backend(name: str | None = None) -> AttentionBackend:
    """A fresh backend instance by name (None: the default)."""
    chosen = name or DEFAULT_ATTENTION_BACKEND
    backend_cls = ATTENTION_BACKENDS.get(chosen)
    if backend_cls is None:
        raise ValueError(
            f"unknown attention backend {chosen!r}; choose one of: "
            + ", ".join(sorted(ATTENTION_BACKENDS))
        )
    return backend_cls()
