"""What every attention backend shares: the per-layer spec, the per-step plan, the KV
cache's layout (written by slot, allocated zero-filled), the decode plan of a CUDA graph,
the backend interface, and the causal/windowed masks.

The KV pool is allocated zero-filled because a backend that reads whole blocks, slots
past a request's end included, masks them: a masked score is `score + (-inf)`, so a NaN
left in uninitialised memory would still poison the row.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from pagellm.model.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionSpec:
    """The per-layer constants a backend needs."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None


@dataclass
class StepPlan:
    """Per-step state shared by all layers; backends subclass it.

    `decode_call`: set where the whole step is one call of the compiled decode kernel,
    every request one query in batch order: (block tables, key lengths, the shared
    prefix's blocks or None, the prefill kernel's [3, R] starts, lens and contexts where
    it attends instead (row-invariant attention) or None, whether with bfloat16
    products), so that a layer may run as the one `decode_layer` op."""

    meta: AttentionMetadata
    decode_call: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                       bool] | None = field(default=None, kw_only=True)


def write_kv_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new key/value rows [T, Hkv, D] at flat slots of a [2, N, B, Hkv, D] cache,
    rounded to the cache's dtype where it is kept in another (kv_cache_dtype). Every
    backend reads a step's own keys back from the cache, never the unrounded rows, so a
    step attends to its new keys exactly as later steps will read them there."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, key.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(flat.dtype))


def allocate_kv_caches(
    num_layers: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One zero-filled KV tensor per layer (zeros: see the module docstring)."""
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


@dataclass
class GraphDecodePlan(StepPlan):
    """A decode step of fixed shape, for capture in a CUDA graph: R rows (some of them
    padding) of one query each, every row's table W blocks wide.

    A captured graph replays the same kernels on the same memory, so nothing here may
    depend on a step's lengths on the host: `meta`'s tensors are the graph runner's static
    buffers, refilled before each replay, its lists only give the captured shape (R rows of
    one query over W blocks), and each row's keys are masked on the device from its
    `seq_lens` entry. The masks are built by the first layer that needs them and shared by
    the rest, so inside a graph they are recorded once per step."""

    masks: dict[tuple[int | None, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def additive_mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """0 where row r's query (at position seq_lens[r] - 1) sees key j, else -inf:
        [R, 1, 1, W * block_size]."""
        cached = self.masks.get((window, dtype))
        if cached is None:
            meta = self.meta
            width = meta.block_tables.shape[1] * meta.block_size
            key_pos = torch.arange(width, device=meta.seq_lens.device)[None, :]
            query_pos = (meta.seq_lens.long() - 1)[:, None]
            visible = window_mask(key_pos <= query_pos, key_pos, query_pos, window)
            cached = additive_scores(visible, dtype)[:, None, None, :]
            self.masks[(window, dtype)] = cached
        return cached


class AttentionBackend(ABC):
    """Interface: plan once per step, then write + attend once per layer."""

    name: str = ""

    def prepare(self, meta: AttentionMetadata) -> StepPlan:
        """Build the per-step plan. The default needs nothing beyond the metadata."""
        return StepPlan(meta)

    def supports_graph_decode(self) -> bool:
        """Whether `attend` takes a GraphDecodePlan (decode steps captured in CUDA graphs;
        see worker/cuda_graphs.py). The default does not: it plans on the host."""
        return False

    def configure(self, specs: list[AttentionSpec]) -> None:  # noqa: B027 - optional hook
        """Called once with every layer's spec, so a backend can turn off paths that some
        layer cannot use (the default needs nothing)."""

    def use_cpu_kernels(self) -> None:  # noqa: B027 - optional hook
        """Called by the loader once the compiled CPU kernels are loaded (cpu_kernels), for
        a backend that has paths using them (the default has none); only for a float32
        model on the CPU, the one case the kernels serve."""

    def use_row_invariant_attention(self, bf16_products: bool) -> bool:
        """Called by the model when its matmuls quantize their inputs to int8
        (EngineConfig.quantize_activations): attend every token, decodes included, by one
        kernel whose result for a query does not depend on the step around it, with its
        products in bfloat16 where `bf16_products`; returns whether every step can (the
        default backend cannot). Why: int8 rounding turns the ~1e-7 by which two
        attention paths differ into whole int8 steps, so a token computed in another
        batch (caching on or off) would part at far more than float32's near-ties."""
        return False

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: StepPlan,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        """Write key/value [T, Hkv, D] into the cache, return attention output [T, H, D]."""
        self.write(kv_cache, key, value, plan)
        return self.attend(query, kv_cache, plan, spec)

    def write(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: StepPlan
    ) -> None:
        """Store the step's new key/value rows [T, Hkv, D] at their slots."""
        write_kv_cache(kv_cache, key, value, plan.meta.slot_mapping)

    @abstractmethod
    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, plan: StepPlan, spec: AttentionSpec
    ) -> torch.Tensor:
        """Attention output [T, H, D] of the step's queries [T, H, D] over the cache, which
        already holds the step's new keys and values (a fused layer stores them itself)."""


def additive_scores(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as scores to add: 0 where visible, -inf elsewhere (a new tensor)."""
    scores = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return scores.masked_fill_(~visible, float("-inf"))


def window_mask(
    mask: torch.Tensor, key_pos: torch.Tensor, query_pos: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Restrict a causal mask to keys within `window` positions of the query."""
    if window is None:
        return mask
    return mask & (key_pos > query_pos - window)
