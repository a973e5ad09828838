"""A tiny stand-in for the worker: block tables, slot mapping and AttentionMetadata.

Tests drive the model through it the way the real runner will: requests get blocks from a
shuffled free list (so block tables are never contiguous), a request can adopt another's
full blocks as a cached prefix, and any mix of prefills, chunks and decodes can share a step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from pagellm.model.attention_metadata import AttentionMetadata


def build_metadata(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for requests with the given blocks, cached tokens and new tokens."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    slots: list[int] = []
    for table, ctx, q_len in zip(block_tables, context_lens, query_lens, strict=True):
        for pos in range(ctx, ctx + q_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    qsl = [0]
    for q_len in query_lens:
        qsl.append(qsl[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        seq_lens_list=seq_lens,
        query_lens_list=list(query_lens),
    )


@dataclass
class _Req:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


class PagedSim:
    """Owns a model's KV caches and the block bookkeeping of a few requests."""

    def __init__(
        self, model: torch.nn.Module, num_blocks: int = 96, block_size: int = 4, seed: int = 0,
        kv_dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.block_size = block_size
        self.kv_caches = model.allocate_kv_caches(num_blocks, block_size, kv_dtype)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.reqs: dict[str, _Req] = {}

    def share_prefix(self, src: str, dst: str, num_tokens: int) -> None:
        """Let `dst` start with the first `num_tokens` (whole blocks) of `src`, already cached."""
        assert num_tokens % self.block_size == 0
        blocks = self.reqs[src].blocks[: num_tokens // self.block_size]
        self.reqs[dst] = _Req(blocks=list(blocks), num_tokens=num_tokens)

    def step(self, batch: list[tuple[str, list[int]]]) -> torch.Tensor:
        """Run one forward over the new tokens of each (request, tokens); logits [T, vocab]."""
        tables, ctx_lens, q_lens, ids, positions = [], [], [], [], []
        for name, tokens in batch:
            req = self.reqs.setdefault(name, _Req())
            total = req.num_tokens + len(tokens)
            while len(req.blocks) * self.block_size < total:
                req.blocks.append(self.free.pop())
            tables.append(req.blocks)
            ctx_lens.append(req.num_tokens)
            q_lens.append(len(tokens))
            ids.extend(tokens)
            positions.extend(range(req.num_tokens, total))
        meta = build_metadata(tables, ctx_lens, q_lens, self.block_size)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
        for name, tokens in batch:
            self.reqs[name].num_tokens += len(tokens)
        return logits
