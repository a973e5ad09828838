"""Decode steps on CUDA replayed from captured graphs instead of launched op by op.

On a GPU this engine's decode step is bound by kernel launches, not arithmetic: a few
hundred small kernels, each launched from Python (on an H200, ~18 ms a step for one
request, whatever the batch). A CUDA graph records a step's kernels once and replays them
with one launch. It replays them on the same memory with the same shapes, so a step is
padded to a captured shape: the batch to the next of a few sizes (powers of two up to
`max_num_seqs`), every block table to the next power-of-two width (up to the widest a
request of `max_model_len` tokens needs). Padding rows write their keys and values into
the KV cache's padding block and their outputs are dropped; padded table columns are
masked. Graphs are captured when a shape is first needed (one eager step plus a capture)
and share one memory pool: only one runs at a time, and each step's output is read before
the next replay. That pool is not part of the KV budget: it holds one layer's gathered
keys and values, and their transposed copies, of the largest step captured (64 rows x
2,048 padded tokens of SmolLM2-135M's shape: ~0.4 GB).

Every row attends over the widest row's table, so a batch of one long request and many
short ones would gather far more keys padded than the eager path does (it groups rows by
length); such a step runs eagerly (see `MAX_PADDED_KEYS`).

Prefill and mixed steps stay eager: their shapes vary with every prompt, and their kernels
are large enough to hide the launches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagellm.core.kv_cache_manager import blocks_for_tokens
from pagellm.model.attention import GraphDecodePlan
from pagellm.model.attention_metadata import AttentionMetadata
from pagellm.model.llama import LlamaForCausalLM
from pagellm.worker.input_batch import ModelInputs
from pagellm.worker.kv_cache import KVCache

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger(__name__)

# A step whose padded tables hold more keys than this, and more than twice the keys its
# rows use, runs eagerly. On an H200 (SmolLM2-135M's shape, float32) a graph's decode step
# took ~3.5 ms plus ~0.12 ms per 1,000 padded keys, and an eager one 16-20 ms: at 64 rows x
# 2,048 padded keys the two were even.
MAX_PADDED_KEYS = 1 << 16


def capture_sizes(limit: int) -> list[int]:
    """Powers of two below `limit`, then `limit`: the padded sizes a dimension may take
    (padding at most doubles a step's work)."""
    sizes = []
    size = 1
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]


def _padded(size: int, sizes: list[int]) -> int:
    return next(s for s in sizes if s >= size)


@dataclass
class _StaticInputs:
    """The buffers every graph reads: a step's inputs are copied into their first rows."""

    input_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    slot_mapping: torch.Tensor  # [max_batch] int64
    seq_lens: torch.Tensor  # [max_batch] int32
    block_tables: torch.Tensor  # [max_batch, max_width] int32


class CudaGraphRunner:
    """Runs decode-only steps from CUDA graphs, one per (batch size, table width) used."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, max_batch: int,
                 max_model_len: int) -> None:
        if kv_cache.padding_block is None:
            raise ValueError("CUDA graphs need a KV cache with a padding block")
        self.model = model
        self.kv_cache = kv_cache
        self.batch_sizes = capture_sizes(max_batch)
        self.widths = capture_sizes(blocks_for_tokens(max_model_len, kv_cache.block_size))
        device = kv_cache.tensors[0].device
        padding = kv_cache.padding_block
        max_rows, max_width = self.batch_sizes[-1], self.widths[-1]
        self._padding_block = padding
        self._pad_slot = padding * kv_cache.block_size

        def full(shape: tuple[int, ...], value: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full(shape, value, dtype=dtype, device=device)

        # Padding rows start as one token at position 0 over the padding block, so what
        # they compute is finite (a NaN written to the padding block would reach a real
        # row through a masked key: -inf + NaN is NaN).
        self._inputs = _StaticInputs(
            input_ids=full((max_rows,), 0, torch.long),
            positions=full((max_rows,), 0, torch.long),
            slot_mapping=full((max_rows,), self._pad_slot, torch.long),
            seq_lens=full((max_rows,), 1, torch.int32),
            block_tables=full((max_rows, max_width), padding, torch.int32),
        )
        # A shape whose capture failed maps to None and runs eagerly from then on.
        self._replays: dict[tuple[int, int], Callable[[], torch.Tensor] | None] = {}
        self._pool: _POOL_HANDLE | None = None

    @property
    def num_graphs(self) -> int:
        return sum(replay is not None for replay in self._replays.values())

    def forward(self, inputs: ModelInputs) -> torch.Tensor | None:
        """Hidden states [R, H] of a decode-only step (one token per request), or None when
        the step runs eagerly: larger than any captured shape, padded too wide (see
        MAX_PADDED_KEYS), or of a shape whose capture failed."""
        meta = inputs.attn_metadata
        rows, width = meta.block_tables.shape
        if rows > self.batch_sizes[-1] or width > self.widths[-1]:
            return None
        shape = (_padded(rows, self.batch_sizes), _padded(width, self.widths))
        padded_keys = shape[0] * shape[1] * self.kv_cache.block_size
        if padded_keys > MAX_PADDED_KEYS and padded_keys > 2 * sum(meta.seq_lens_list):
            return None
        captured = shape in self._replays
        if captured and self._replays[shape] is None:
            return None
        self._fill(inputs, shape[0])
        if not captured:
            self._replays[shape] = self._capture_or_none(*shape)
        replay = self._replays[shape]
        return None if replay is None else replay()[:rows]

    def _capture_or_none(self, batch: int, width: int) -> Callable[[], torch.Tensor] | None:
        """The shape's replay, or None (logged once) when it cannot be captured: that
        shape then runs eagerly."""
        try:
            return self._capture(batch, width)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            logger.warning("decode steps of %d rows x %d blocks run eagerly: their CUDA "
                           "graph could not be captured (%s)", batch, width, exc)
            return None

    def _fill(self, inputs: ModelInputs, batch: int) -> None:
        """Copies the step's inputs into the static buffers and resets the padding rows
        to one token at position 0 over the padding block. Left as an earlier step had
        them, a padding row could see no key at all (a sliding window past the padded
        width), and the NaN of its empty softmax would land in the padding block, where
        the masked columns of real rows read it (-inf + NaN is NaN)."""
        meta = inputs.attn_metadata
        rows, width = meta.block_tables.shape
        static = self._inputs
        static.input_ids[:rows].copy_(inputs.input_ids)
        static.positions[:rows].copy_(inputs.positions)
        static.slot_mapping[:rows].copy_(meta.slot_mapping)
        static.seq_lens[:rows].copy_(meta.seq_lens)
        static.block_tables[:rows, :width].copy_(meta.block_tables)
        if batch > rows:
            static.positions[rows:batch].zero_()
            static.slot_mapping[rows:batch].fill_(self._pad_slot)
            static.seq_lens[rows:batch].fill_(1)
            static.block_tables[rows:batch, 0].fill_(self._padding_block)

    def _capture(self, batch: int, width: int) -> Callable[[], torch.Tensor]:
        """Records the step of `batch` rows over tables `width` blocks wide, with the
        buffers already holding the current step, and returns its replay."""
        static = self._inputs
        meta = AttentionMetadata(
            slot_mapping=static.slot_mapping[:batch],
            block_tables=static.block_tables[:batch, :width],
            seq_lens=static.seq_lens[:batch],
            # Only the buffers above and block_size are read (see GraphDecodePlan); these
            # record the captured shape, not a step's lengths.
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32,
                                         device=static.seq_lens.device),
            context_lens=static.seq_lens[:batch] - 1,
            max_query_len=1,
            max_seq_len=width * self.kv_cache.block_size,
            block_size=self.kv_cache.block_size,
            seq_lens_list=[width * self.kv_cache.block_size] * batch,
            query_lens_list=[1] * batch,
        )

        def step() -> torch.Tensor:
            return self.model.forward_planned(
                static.input_ids[:batch], static.positions[:batch], self.kv_cache.tensors,
                GraphDecodePlan(meta))

        replay = self._record(step)
        logger.debug("captured a CUDA graph for decode steps of %d rows x %d blocks",
                     batch, width)
        return replay

    def _record(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Runs `step` once eagerly on a side stream (first calls initialise libraries
        and lazy caches, which must not happen inside a capture), then captures it into
        the shared pool. Running it twice is harmless: a step writes the same keys and
        values to the same slots."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            output = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay
