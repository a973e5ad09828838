"""Which blocks each request holds, and how a new request reuses cached ones.

The scheduler asks three questions of this class: how much of a request's prompt is
already cached (`find_cached_prefix`), can it get the blocks for the tokens it is about to
compute (`allocate`, all or nothing), and, once they are computed, which of its blocks are
now full and can be published for other requests (`cache_full_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.core.block_pool import BlockPool, KVBlock
from pagellm.core.events import KVCacheEvent
from pagellm.core.request import Request


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens: the one count every layer uses (block
    tables, attention's tiles, pool sizes), so none rounds its own way."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters since start-up; `hit_rate` is hit tokens over queried tokens."""

    queries: int
    hits: int
    blocks_in_use: int
    blocks_free: int
    blocks_cached: int
    evictions: int
    num_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def usage(self) -> float:
        return self.blocks_in_use / self.num_blocks


class OutOfBlocksError(RuntimeError):
    """No free block is left for an operation that cannot wait (a fork's copy)."""


@dataclass(frozen=True)
class BlockCopy:
    """Copy-on-write: copy the KV slots of block `src` into block `dst` before it is used."""

    src: int
    dst: int


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        enable_events: bool = False,
        index_children: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, enable_events, index_children)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # How many of a request's leading blocks are already published in the cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Requests holding a block whose twin was published instead (see cache_full_blocks).
        self._with_twins: set[str] = set()
        self._queries = 0
        self._hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def max_hit_blocks(self, request: Request) -> int:
        """How many leading blocks the request may take from the cache.

        Never the last token: its logits are needed, so at least one token is always
        computed, even when the whole prompt is cached.
        """
        if not self.enable_caching or self._skips_reading(request):
            return 0
        return (request.num_tokens - 1) // self.block_size

    @staticmethod
    def _skips_reading(request: Request) -> bool:
        """Whether the request's prompt must be computed whole: it asked so
        (`skip_reading_prefix_cache`), as a request for prompt logprobs does, which needs
        the logits of every prompt position, and a cached block has none. Once it has an
        output token its prompt was computed (a resume after preemption), so it reads the
        cache like any other; it is not counted in the hit rate before that."""
        params = request.sampling_params
        return ((bool(params.skip_reading_prefix_cache) or params.prompt_logprobs is not None)
                and request.num_output_tokens == 0)

    def _counts_lookup(self, request: Request) -> bool:
        """Whether this lookup goes into the hit rate: a request's first only, as vLLM
        counts (it keeps resumed ones apart). A request resumed after preemption, or a
        sibling that waited for a seat instead of forking, looks its prompt up again, and
        counting that would make the same request's hit rate depend on the pool's size
        and `max_num_seqs`."""
        return (request.num_output_tokens == 0 and request.num_preemptions == 0
                and not self._skips_reading(request))

    def find_cached_prefix(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of the request's leading blocks found in the cache, within
        `max_hit_blocks`. The hit stops at the first missing block (chaining makes later
        hits impossible anyway)."""
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[: self.max_hit_blocks(request)]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def departure(self, request: Request, num_hit_blocks: int) -> int | None:
        """Where the request's tokens part from the cached prefix that comes closest: the
        index of its first token that no cached continuation of its `num_hit_blocks` hit
        blocks shares, or None when nothing cached continues from there (or the pool does
        not index children). A chat template that renders an earlier turn differently
        shows up here as a departure long before the new turn."""
        if num_hit_blocks >= len(request.block_hashes):
            return None
        parent = request.parent_hash(num_hit_blocks) or request.root_hash
        by_first = self.pool.cached_children(parent)
        if not by_first:
            return None
        tokens = request.block_token_ids(num_hit_blocks)
        # Only continuations with the same first token can share more than none of it.
        shared = max((_common_prefix_len(tokens, other)
                      for other in by_first.get(tokens[0], {}).values()), default=0)
        if shared == len(tokens):  # the block is cached: the hit stopped short of it
            return None
        return num_hit_blocks * self.block_size + shared

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        cached_blocks: list[KVBlock] | None = None,
        reserve: int = 0,
    ) -> list[KVBlock] | None:
        """Gives the request enough blocks to hold its computed tokens plus `num_new_tokens`.

        `cached_blocks` (from `find_cached_prefix`) are taken only on the request's first
        allocation and count as computed. `reserve` blocks must stay free afterwards.
        Returns the newly allocated blocks, or None when they do not fit, in which case
        nothing at all has changed: no references taken on the hits, no blocks taken from
        the pool.
        """
        cached_blocks = cached_blocks or []
        held = self.req_to_blocks.get(request.request_id)
        if cached_blocks and held:
            raise ValueError(f"{request.request_id}: cached blocks given to a request that "
                             "already holds blocks")
        for index, block in enumerate(cached_blocks):
            if block.block_hash != request.block_hashes[index]:
                raise ValueError(
                    f"{request.request_id}: cached block {block.block_id} was evicted after "
                    "the look-up; call allocate right after find_cached_prefix")
        num_held = len(held) if held else 0
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        num_needed = self.blocks_needed(num_computed + num_new_tokens) - num_held - len(
            cached_blocks)
        num_needed = max(num_needed, 0)
        # Hits that are cached-free leave the free queue when touched.
        num_revived = sum(1 for block in cached_blocks if block.ref_count == 0)
        if num_needed + num_revived + reserve > self.pool.num_free_blocks:
            return None
        if held is None:
            held = self.req_to_blocks[request.request_id] = []
            self._num_cached_blocks[request.request_id] = len(cached_blocks)
            if self._counts_lookup(request):
                self._queries += request.num_tokens
                self._hits += len(cached_blocks) * self.block_size
        self.pool.touch(cached_blocks)
        held.extend(cached_blocks)
        new_blocks = self.pool.allocate(num_needed)
        held.extend(new_blocks)
        return new_blocks

    def cache_full_blocks(self, request: Request) -> None:
        """Publishes the request's blocks that are now full of computed tokens."""
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            return
        rid = request.request_id
        num_full = min(
            request.num_computed_tokens // self.block_size,
            len(request.block_hashes),
            len(blocks),
        )
        first = self._num_cached_blocks[rid]
        if first >= num_full:  # nothing new (most decode steps)
            return
        # A block computed by two requests at once is published once, and the other copy
        # stays a twin without a hash. When the published copy is evicted while the twin's
        # request goes on, the twin is published in its place before a new block goes
        # under it (a block under an ancestor nobody can find is unreachable), and at the
        # latest when its request frees it.
        self._publish(request, blocks, [*self._lost_twins(request), *range(first, num_full)])
        self._num_cached_blocks[rid] = num_full

    def _lost_twins(self, request: Request) -> list[int]:
        """The indices of the request's published-range blocks whose hash no block holds
        any more: its twins whose published copy was evicted (a block the request holds
        cannot be). Only requests holding a twin look, one lookup per block."""
        if request.request_id not in self._with_twins:
            return []
        return [index for index in range(self._num_cached_blocks[request.request_id])
                if request.block_hashes[index] not in self.pool.cached]

    def _publish(self, request: Request, blocks: list[KVBlock], indices: list[int]) -> None:
        for index in indices:
            published = self.pool.cache_block(
                blocks[index],
                request.block_hashes[index],
                request.parent_hash(index),
                request.block_token_ids(index),
                request.extra_keys if index == 0 else (),
                request.root_hash,
            )
            if not published and blocks[index].block_hash is None:
                self._with_twins.add(request.request_id)

    def free(self, request: Request) -> None:
        """Drops the request's references; its cached blocks stay findable until evicted,
        its twins too where their published copy was evicted first.

        Freed deepest block first, so that among them the deepest are evicted first.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks:
            self._publish(request, blocks, self._lost_twins(request))
        self.req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self._with_twins.discard(request.request_id)
        if blocks:
            self.pool.free(reversed(blocks))

    def fork(self, parent: Request, child: Request) -> list[BlockCopy]:
        """Shares the parent's blocks with a child (n > 1 sampling).

        Full blocks are shared by reference count. A partly filled last block is never
        shared (both would write their next token into it), so the child gets a fresh block
        and the returned `BlockCopy` says which slots to copy into it before its next step.
        Raises OutOfBlocksError, with nothing changed, when no block is free for the copy.
        """
        parent_blocks = self.req_to_blocks.get(parent.request_id)
        if parent_blocks is None:
            raise ValueError(f"{parent.request_id} holds no blocks to fork")
        if child.request_id in self.req_to_blocks:
            raise ValueError(f"{child.request_id} already holds blocks")
        num_full = parent.num_computed_tokens // self.block_size
        num_partial = 1 if parent.num_computed_tokens % self.block_size else 0
        shared = parent_blocks[:num_full]
        blocks = list(shared)
        copies: list[BlockCopy] = []
        if num_partial:
            if self.pool.num_free_blocks < 1:
                raise OutOfBlocksError(f"no free block to fork {parent.request_id}")
            fresh = self.pool.allocate(1)[0]
            copies.append(BlockCopy(src=parent_blocks[num_full].block_id, dst=fresh.block_id))
            blocks.append(fresh)
        self.pool.touch(shared)
        self.req_to_blocks[child.request_id] = blocks
        self._num_cached_blocks[child.request_id] = min(
            self._num_cached_blocks[parent.request_id], num_full)
        if parent.request_id in self._with_twins:
            self._with_twins.add(child.request_id)
        return copies

    def get_block_ids(self, request: Request) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request.request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        return self.pool.take_events()

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            queries=self._queries,
            hits=self._hits,
            blocks_in_use=self.pool.num_used_blocks,
            blocks_free=self.pool.num_free_blocks,
            blocks_cached=len(self.pool.cached),
            evictions=self.pool.num_evictions,
            num_blocks=self.pool.num_blocks,
        )


def _common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
