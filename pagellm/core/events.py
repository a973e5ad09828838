"""Events that describe how the prefix cache's content changes.

An observer (a router that sends requests to the engine already holding their prefix, a
metrics exporter, a debugger) replays them to know which block hashes an engine holds
without asking it. They are buffered only when someone asked for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.core.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """A full block became findable by `block_hash`; `parent_hash` is None for block 0.

    `extra_keys` are what seeded the chain besides the tokens, given on block 0 only
    (the adapter name, then the cache salt, as vLLM orders its extra keys): the same
    tokens under another salt are other blocks, which an observer matching requests by
    their tokens must tell apart."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_id: int
    extra_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class BlockRemoved:
    """A cached block was evicted for reuse: its hash no longer finds anything."""

    block_hash: BlockHash
    block_id: int


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
