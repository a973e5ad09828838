"""The pool of KV blocks: reference counts, the eviction queue and the hash -> block map.

A block is in one of three states, and their counts always add up to `num_blocks`:
- in use: ref_count >= 1, held by one or more requests (shared prefix blocks, forks);
- cached-free: ref_count 0 but still holding a full block of KV findable by its hash; it
  sits in the free queue and is reused only when nothing emptier is left;
- empty-free: ref_count 0 and no hash; it sits at the front of the free queue.

The free queue is a doubly linked list threaded through the blocks themselves, so taking a
block off it on a cache hit (`touch`) is O(1), as is eviction from its head.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pagellm.core.block_hash import BlockHash
from pagellm.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


class KVBlock:
    """Bookkeeping for one block of KV slots (the tensors live in the worker)."""

    __slots__ = ("block_id", "ref_count", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_count}, hash={cached})"


class FreeBlockQueue:
    """Free blocks in reuse order: the head is taken first.

    Sentinel head and tail nodes keep every operation branch-free and O(1).
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free block left")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        """Adds at the tail: reused last (the most recently used cached block)."""
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVBlock) -> None:
        """Adds at the head: reused first (a block holding nothing worth keeping)."""
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVBlock | None, block: KVBlock) -> None:
        if prev is None or prev.next_free is None:
            raise AssertionError("free queue is corrupt")
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        nxt = prev.next_free
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    """Owns every block; hands them out, takes them back, and keeps the prefix cache map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 enable_events: bool = False, index_children: bool = False) -> None:
        """`index_children` keeps, for each cached block (and each chain's root hash),
        the tokens of the cached blocks that follow it, by their first token, so that a
        miss can be explained: where a prompt departs from the cached prefix it came
        closest to (see KVCacheManager.departure). It costs a dict entry per cached
        block, so it is kept only when that is logged."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self._enable_events = enable_events
        self._events: list[KVCacheEvent] = []
        self._index_children = index_children
        # parent (or chain root) -> first token -> {child hash: child tokens}
        self._children: dict[BlockHash, dict[int, dict[BlockHash, tuple[int, ...]]]] = {}
        self._parent_of: dict[BlockHash, tuple[BlockHash, int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        """Takes `n` blocks from the head of the free queue, evicting their cached content.

        The caller checks `num_free_blocks` first; asking for more is a bug, not a miss.
        """
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} blocks, only {self.free_queue.num_free} free")
        taken = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def _evict(self, block: KVBlock) -> None:
        """Forgets a cached block's hash before its slots are overwritten with other tokens."""
        assert block.block_hash is not None
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self._index_children:
                parent, first = self._parent_of.pop(block.block_hash)
                by_first = self._children[parent]
                del by_first[first][block.block_hash]
                if not by_first[first]:
                    del by_first[first]
                if not by_first:
                    del self._children[parent]
        if self._enable_events:
            self._events.append(BlockRemoved(block.block_hash, block.block_id))
        block.block_hash = None
        self.num_evictions += 1

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes a reference on each block (a cache hit or a fork).

        A cached-free block leaves the free queue but keeps its hash: it is being reused
        for exactly the tokens it holds.
        """
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference from each block, in the order given.

        Blocks that reach zero and hold cached KV go to the tail in that order, so the
        caller passes a request's blocks deepest first: the deepest are then evicted first
        and shared roots survive longest. Blocks without a hash go to the head.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self.free_queue.append(block)
                else:
                    self.free_queue.appendleft(block)

    def cache_block(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: tuple[int, ...],
        extra_keys: tuple[str, ...] = (),
        chain_root: BlockHash = b"",
    ) -> bool:
        """Makes a full, computed block findable by its hash.

        Returns False when another block already holds this hash: two requests computed the
        same block in the same step. The map keeps the first one and this block stays
        unhashed, so it returns to the pool as an empty block when its owner frees it.
        """
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self._index_children:
            parent = parent_hash if parent_hash is not None else chain_root
            self._children.setdefault(parent, {}).setdefault(
                token_ids[0], {})[block_hash] = token_ids
            self._parent_of[block_hash] = (parent, token_ids[0])
        if self._enable_events:
            self._events.append(BlockStored(block_hash, parent_hash, token_ids, block.block_id,
                                            extra_keys))
        return True

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; False, changing nothing, while any block is in use
        (vLLM's answer too): a running request's blocks may be registered later, and
        dropping hashes under it would leave the map and the blocks disagreeing.
        """
        if self.num_used_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self._children.clear()
        self._parent_of.clear()
        if self._enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def cached_children(self, parent: BlockHash) -> dict[int, dict[BlockHash, tuple[int, ...]]]:
        """The cached blocks that follow `parent` (a block's hash, or a chain's root hash
        for its first blocks), by first token, with their tokens; empty unless the pool
        indexes children."""
        return self._children.get(parent, {})

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
