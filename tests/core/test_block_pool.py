"""BlockPool and its free queue: states, LRU eviction, stale-hash and accounting pitfalls."""

from __future__ import annotations

import pytest

from pagellm.core.block_pool import BlockPool, FreeBlockQueue, KVBlock
from pagellm.core.events import AllBlocksCleared, BlockRemoved, BlockStored


def h(n: int) -> bytes:
    return n.to_bytes(32, "little")


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def cache(pool: BlockPool, block: KVBlock, n: int) -> bool:
    return pool.cache_block(block, h(n), None, (n,))


# --- free queue -----------------------------------------------------------------------


def test_free_queue_order_and_ops() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    q.append(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2]
    q.remove(blocks[2])
    q.appendleft(blocks[2])
    assert [b.block_id for b in q] == [2, 0, 1, 3, 4]
    assert q.popleft() is blocks[2]
    for expected in (0, 1, 3, 4):
        assert q.popleft().block_id == expected
    assert len(q) == 0 and list(q) == []
    with pytest.raises(IndexError):
        q.popleft()


def test_free_queue_rejects_bad_membership() -> None:
    blocks = [KVBlock(i) for i in range(2)]
    q = FreeBlockQueue(blocks)
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[0])
    with pytest.raises(ValueError, match="already in the free queue"):
        q.appendleft(blocks[1])
    q.remove(blocks[0])
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[0])
    assert len(q) == 1


class _CountingBlock(KVBlock):
    """Counts every read of the link fields: a structural (not timed) cost measure."""

    __slots__ = ()
    reads = 0

    def __getattribute__(self, name: str) -> object:
        if name in ("prev_free", "next_free"):
            type(self).reads += 1
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("op", ["remove_middle", "popleft", "append", "appendleft"])
def test_free_queue_ops_are_constant_time(op: str) -> None:
    """Each operation touches a bounded number of links whatever the queue's length."""
    costs = []
    for n in (10, 1000):
        blocks: list[KVBlock] = [_CountingBlock(i) for i in range(n)]
        extra = _CountingBlock(n)
        q = FreeBlockQueue(blocks)
        _CountingBlock.reads = 0
        if op == "remove_middle":
            q.remove(blocks[n // 2])
        elif op == "popleft":
            q.popleft()
        elif op == "append":
            q.append(extra)
        else:
            q.appendleft(extra)
        costs.append(_CountingBlock.reads)
    assert 0 < costs[0] == costs[1] <= 8, costs


def test_free_queue_uses_no_linear_containers() -> None:
    """The queue is intrusive: no list/deque whose remove() would be O(n)."""
    q = FreeBlockQueue([KVBlock(i) for i in range(4)])
    for value in vars(q).values():
        assert not isinstance(value, (list, tuple, dict, set))


# --- pool states and accounting -------------------------------------------------------


def test_initial_state() -> None:
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0 and pool.usage == 0.0
    assert all(b.ref_count == 0 and b.block_hash is None for b in pool.blocks)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_takes_from_head_and_counts(check_pool) -> None:
    pool = BlockPool(4)
    taken = pool.allocate(3)
    assert [b.block_id for b in taken] == [0, 1, 2]
    assert all(b.ref_count == 1 for b in taken)
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 3 and pool.usage == 0.75
    with pytest.raises(ValueError, match="only 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    check_pool(pool)


def test_double_free_raises(check_pool) -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(ValueError, match="double free"):
        pool.free([block])
    assert block.ref_count == 0 and pool.num_free_blocks == 2
    check_pool(pool)


def test_shared_block_freed_once_per_reference(check_pool) -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.touch([block])
    assert block.ref_count == 2
    pool.free([block])
    assert block.ref_count == 1 and pool.num_free_blocks == 1
    pool.free([block])
    assert block.ref_count == 0 and pool.num_free_blocks == 2
    check_pool(pool)


def test_freed_unhashed_blocks_go_to_head_hashed_to_tail() -> None:
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)  # queue: [3]
    cache(pool, b, 1)
    pool.free([a, b, c])
    # a and c hold nothing worth keeping: reused before block 3 and before cached b.
    assert queue_ids(pool) == [c.block_id, a.block_id, 3, b.block_id]


def test_touch_of_cached_free_block_keeps_hash_and_leaves_queue(check_pool) -> None:
    pool = BlockPool(3)
    [block] = pool.allocate(1)
    cache(pool, block, 7)
    pool.free([block])
    assert block.block_id in queue_ids(pool) and pool.num_free_blocks == 3
    pool.touch([block])
    assert block.ref_count == 1
    assert block.block_hash == h(7) and pool.get_cached_block(h(7)) is block
    assert block.block_id not in queue_ids(pool) and pool.num_free_blocks == 2
    # Allocating everything else must not evict it.
    pool.allocate(2)
    assert pool.get_cached_block(h(7)) is block and pool.num_evictions == 0
    check_pool(pool)


def test_touch_of_in_use_block_only_counts() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.touch([block])
    assert block.ref_count == 2 and pool.num_free_blocks == 1


def test_eviction_is_lru() -> None:
    pool = BlockPool(3, enable_events=True)
    blocks = pool.allocate(3)
    for n, block in enumerate(blocks):
        cache(pool, block, n)
    # Freed at different times: 2, then 0, then 1.
    for i in (2, 0, 1):
        pool.free([blocks[i]])
    pool.take_events()
    order = [pool.allocate(1)[0].block_id for _ in range(3)]
    assert order == [2, 0, 1]
    assert pool.num_evictions == 3 and pool.cached == {}
    removed = [e for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert [(e.block_id, e.block_hash) for e in removed] == [(2, h(2)), (0, h(0)), (1, h(1))]


def test_hit_refreshes_lru_position() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    cache(pool, a, 1)
    cache(pool, b, 2)
    pool.free([a])
    pool.free([b])  # LRU order: a, b
    pool.touch([a])  # a is used again...
    pool.free([a])  # ...so b is now the least recently used
    assert pool.allocate(1)[0] is b
    assert pool.get_cached_block(h(1)) is a and pool.get_cached_block(h(2)) is None


def test_deepest_freed_together_evicted_first() -> None:
    """The caller frees a request's blocks deepest first; the pool keeps that order."""
    pool = BlockPool(4)
    chain = pool.allocate(4)
    for n, block in enumerate(chain):
        cache(pool, block, n)
    pool.free(list(reversed(chain)))
    assert [pool.allocate(1)[0].block_id for _ in range(4)] == [3, 2, 1, 0]


def test_eviction_removes_hash_before_reuse(check_pool) -> None:
    """Stale hash -> block entry: an evicted block must not be found by its old hash."""
    pool = BlockPool(1, enable_events=True)
    [block] = pool.allocate(1)
    assert cache(pool, block, 1)
    pool.free([block])
    assert pool.get_cached_block(h(1)) is block
    [reused] = pool.allocate(1)
    assert reused is block
    assert block.block_hash is None and pool.get_cached_block(h(1)) is None
    assert block.ref_count == 1
    # It can now be cached again under its new content.
    assert cache(pool, block, 2)
    assert pool.get_cached_block(h(2)) is block
    events = pool.take_events()
    assert events == [
        BlockStored(h(1), None, (1,), 0),
        BlockRemoved(h(1), 0),
        BlockStored(h(2), None, (2,), 0),
    ]
    check_pool(pool)


def test_duplicate_hash_keeps_first_and_leaves_second_unhashed(check_pool) -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert cache(pool, a, 5)
    assert not cache(pool, b, 5)
    assert b.block_hash is None and pool.get_cached_block(h(5)) is a
    pool.free([b])
    assert queue_ids(pool)[0] == b.block_id  # returned as an empty block
    pool.free([a])
    # Evicting a does not disturb anything else; nothing stale remains.
    pool.allocate(3)
    assert pool.cached == {}
    check_pool(pool)


def test_cache_block_refuses_rehash_and_disabled_caching() -> None:
    pool = BlockPool(2)
    [a] = pool.allocate(1)
    assert cache(pool, a, 1)
    assert not pool.cache_block(a, h(2), None, (2,))
    assert a.block_hash == h(1) and h(2) not in pool.cached
    off = BlockPool(2, enable_caching=False)
    [b] = off.allocate(1)
    assert not cache(off, b, 1) and b.block_hash is None and off.cached == {}


def test_reset_prefix_cache_refused_in_use_and_works_idle(check_pool) -> None:
    pool = BlockPool(3, enable_events=True)
    a, b = pool.allocate(2)
    cache(pool, a, 1)
    cache(pool, b, 2)
    pool.free([b])
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h(1)) is a and pool.get_cached_block(h(2)) is b
    assert pool.take_events() == []
    pool.free([a])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {} and a.block_hash is None and b.block_hash is None
    assert pool.num_free_blocks == 3
    assert pool.take_events() == [AllBlocksCleared()]
    # Reusing the previously cached blocks is not an eviction any more.
    pool.allocate(3)
    assert pool.num_evictions == 0
    check_pool(pool)


def test_events_only_when_enabled_and_taken_once() -> None:
    pool = BlockPool(2)
    [a] = pool.allocate(1)
    cache(pool, a, 1)
    assert pool.take_events() == []
    pool = BlockPool(2, enable_events=True)
    [a] = pool.allocate(1)
    pool.cache_block(a, h(1), h(0), (4, 5))
    assert pool.take_events() == [BlockStored(h(1), h(0), (4, 5), a.block_id)]
    assert pool.take_events() == []
