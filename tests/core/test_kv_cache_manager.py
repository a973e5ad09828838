"""KVCacheManager: prefix hits, all-or-nothing allocation, fork/COW, eviction, stats."""

from __future__ import annotations

import pytest

from pagellm.core.block_hash import BlockHasher
from pagellm.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagellm.core.kv_cache_manager import BlockCopy, KVCacheManager, OutOfBlocksError
from pagellm.core.request import Request
from pagellm.core.sampling_params import SamplingParams

BS = 4


def snapshot(manager: KVCacheManager) -> tuple[object, ...]:
    """Everything allocation may change, for 'nothing changed' assertions."""
    pool = manager.pool
    return (
        [(b.ref_count, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_queue],
        dict(pool.cached),
        {rid: [b.block_id for b in blocks] for rid, blocks in manager.req_to_blocks.items()},
        dict(manager._num_cached_blocks),
        manager.stats(),
    )


def assert_idle_and_clean(manager: KVCacheManager, check_pool) -> None:
    """The leak check: idle engine -> every block free and every ref count 0."""
    assert manager.req_to_blocks == {}
    assert manager.num_free_blocks == manager.num_blocks
    assert all(b.ref_count == 0 for b in manager.pool.blocks)
    check_pool(manager.pool)


# --- hits -------------------------------------------------------------------------------


def test_cold_miss_then_full_block_hit(manager, make_request, run_prompt, check_pool) -> None:
    a = make_request(list(range(10)))  # 2 full blocks + 2 tokens
    assert run_prompt(manager, a) == 0
    assert len(manager.pool.cached) == 2
    a_ids = manager.get_block_ids(a)
    manager.free(a)
    b = make_request(list(range(10)) + [99])
    hits, num = manager.find_cached_prefix(b)
    assert num == 8 and [x.block_hash for x in hits] == b.block_hashes[:2]
    assert [x.block_id for x in hits] == a_ids[:2]  # the very blocks a computed
    assert manager.num_free_blocks == manager.num_blocks  # a lookup takes nothing
    check_pool(manager.pool)


def test_partial_block_is_never_shared(manager, make_request, run_prompt) -> None:
    a = make_request([1, 2, 3, 4, 5, 6])
    run_prompt(manager, a)
    a_partial = manager.req_to_blocks[a.request_id][1]
    assert a_partial.block_hash is None
    b = make_request([1, 2, 3, 4, 5, 6, 7])
    hits, num = manager.find_cached_prefix(b)
    assert num == 4 and len(hits) == 1  # only the full block
    new = manager.allocate(b, b.num_tokens - num, hits)
    assert new is not None and a_partial not in manager.req_to_blocks[b.request_id]


def test_hit_stops_at_first_missing_block(manager, make_request, run_prompt) -> None:
    a = make_request(list(range(16)) + [0])
    run_prompt(manager, a)
    manager.free(a)
    # Drop the cached block 1 from the map by hand (as if evicted): blocks 2 and 3 are
    # still in the map, but a hit on them without block 1 would be meaningless.
    block1 = manager.pool.cached.pop(a.block_hashes[1])
    block1.block_hash = None
    b = make_request(list(range(16)) + [0])
    hits, num = manager.find_cached_prefix(b)
    assert num == 4 and [x.block_hash for x in hits] == [a.block_hashes[0]]


def test_divergence_mid_prompt(manager, make_request, run_prompt) -> None:
    run_prompt(manager, make_request(list(range(16)) + [0]))
    b = make_request([0, 1, 2, 3, 4, 5, 77, 7, 8, 9, 10, 11, 12])
    assert manager.find_cached_prefix(b)[1] == 4


@pytest.mark.parametrize("k", [1, 2, 3])
def test_prompt_exactly_k_blocks_long(manager, make_request, run_prompt, k) -> None:
    prompt = list(range(k * BS))
    a = make_request(prompt)
    run_prompt(manager, a)
    assert len(manager.pool.cached) == k  # every block of it is cached
    manager.free(a)
    b = make_request(prompt)
    hits, num = manager.find_cached_prefix(b)
    # Capped at len-1 = k*BS-1 tokens, rounded down to a block: k-1 blocks.
    assert num == (k - 1) * BS and len(hits) == k - 1
    new = manager.allocate(b, b.num_tokens - num, hits)
    assert new is not None and len(new) == 1
    b.num_computed_tokens = num
    assert b.num_tokens - b.num_computed_tokens == BS  # last block recomputed, incl. last token


def test_single_token_prompt(manager, make_request, run_prompt) -> None:
    a = make_request([5])
    assert run_prompt(manager, a) == 0
    assert manager.find_cached_prefix(make_request([5]))[1] == 0


@pytest.mark.parametrize("length", range(1, 14))
def test_last_prompt_token_always_computed(manager, make_request, run_prompt, length) -> None:
    prompt = list(range(length))
    run_prompt(manager, make_request(prompt))
    again = make_request(prompt)
    _, num = manager.find_cached_prefix(again)
    assert num <= length - 1 and num % BS == 0
    assert num == (length - 1) // BS * BS


def test_repeated_identical_prompt(manager, make_request, run_prompt, check_pool) -> None:
    prompt = list(range(10))
    hits = []
    for _ in range(5):
        r = make_request(prompt)
        hits.append(run_prompt(manager, r))
        manager.free(r)
        check_pool(manager.pool)
    assert hits == [0, 8, 8, 8, 8]
    assert len(manager.pool.cached) == 2 and manager.stats().evictions == 0
    assert_idle_and_clean(manager, check_pool)


def test_concurrent_identical_prompts_share_blocks(manager, make_request, run_prompt) -> None:
    a = make_request(list(range(9)))
    run_prompt(manager, a)
    b = make_request(list(range(9)))
    assert run_prompt(manager, b) == 8
    shared = manager.req_to_blocks[a.request_id][:2]
    assert manager.req_to_blocks[b.request_id][:2] == shared
    assert all(block.ref_count == 2 for block in shared)
    # Each has its own last (partial) block.
    assert manager.req_to_blocks[a.request_id][2] is not manager.req_to_blocks[b.request_id][2]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}),
        ({}, {"cache_salt": "tenant-a"}),
        ({"cache_salt": "tenant-a"}, {}),
        ({"adapter": "lora-1"}, {"adapter": "lora-2"}),
        ({}, {"adapter": "lora-1"}),
    ],
)
def test_salt_and_adapter_isolate(manager, make_request, run_prompt, first, second) -> None:
    prompt = list(range(13))
    run_prompt(manager, make_request(prompt, **first))
    other = make_request(prompt, **second)
    assert manager.find_cached_prefix(other) == ([], 0)
    same = make_request(prompt, **first)
    assert manager.find_cached_prefix(same)[1] == 12


def test_caching_disabled(make_request, run_prompt, check_pool) -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    for _ in range(3):
        r = make_request(list(range(10)))
        assert run_prompt(manager, r) == 0
        manager.free(r)
    assert manager.pool.cached == {} and manager.stats().hits == 0
    assert_idle_and_clean(manager, check_pool)


# --- allocation -------------------------------------------------------------------------


def test_allocate_counts_blocks_and_extends(manager, make_request) -> None:
    r = make_request(list(range(6)))
    new = manager.allocate(r, 6)
    assert new is not None and len(new) == 2
    r.num_computed_tokens = 6
    assert manager.allocate(r, 2) == []  # still fits in block 1
    assert manager.get_block_ids(r) == [b.block_id for b in new]
    more = manager.allocate(r, 3)
    assert more is not None and len(more) == 1
    assert manager.num_free_blocks == 13


def test_allocation_that_does_not_fit_changes_nothing(make_request, run_prompt) -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request(list(range(9)))
    run_prompt(manager, a)  # 3 blocks, 2 cached
    b = make_request(list(range(8)) + [50] * 20)  # hits 2 in-use blocks, needs 5 more
    hits, num = manager.find_cached_prefix(b)
    assert num == 8
    before = snapshot(manager)
    assert manager.allocate(b, b.num_tokens - num, hits) is None
    assert snapshot(manager) == before
    assert all(h.ref_count == 1 for h in hits)
    assert b.request_id not in manager.req_to_blocks


def test_failed_allocation_with_cached_free_hits_changes_nothing(
    make_request, run_prompt, check_pool
) -> None:
    """A failed allocation must not take the cached-free hits off the free queue."""
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request(list(range(9)))
    run_prompt(manager, a)
    manager.free(a)  # blocks 0, 1 cached-free; 2 empty
    hog = make_request([7, 7])
    assert manager.allocate(hog, 8) is not None  # takes the 2 empty blocks
    assert manager.num_free_blocks == 2
    b = make_request(list(range(8)) + [9] * 5)  # 2 hits (cached-free) + 2 new: 4 > 2 free
    hits, num = manager.find_cached_prefix(b)
    assert num == 8 and all(h.ref_count == 0 for h in hits)
    before = snapshot(manager)
    assert manager.allocate(b, b.num_tokens - num, hits) is None
    assert snapshot(manager) == before
    assert all(h.ref_count == 0 for h in hits) and manager.num_free_blocks == 2
    # Exactly fitting (2 revived, 0 new... +1 new would not fit): prompt 9 tokens -> 1 new.
    c = make_request(list(range(8)) + [9])
    hits, num = manager.find_cached_prefix(c)
    assert manager.allocate(c, c.num_tokens - num, hits) is None  # 2 revived + 1 new > 2
    manager.free(hog)
    assert manager.allocate(c, c.num_tokens - num, hits) is not None
    assert all(h.ref_count == 1 for h in hits)
    manager.free(c)
    assert_idle_and_clean(manager, check_pool)


def test_allocation_evicts_cached_blocks_before_refusing(make_request, run_prompt) -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request(list(range(16)))
    run_prompt(manager, a)
    manager.free(a)
    assert len(manager.pool.cached) == 4 and manager.num_free_blocks == 4
    b = make_request([9] * 16)
    assert manager.allocate(b, 16) is not None
    assert manager.pool.cached == {} and manager.stats().evictions == 4


def test_cached_blocks_for_a_request_holding_blocks_rejected(manager, make_request,
                                                             run_prompt) -> None:
    run_prompt(manager, make_request(list(range(9))))
    r = make_request(list(range(9)))
    hits, _ = manager.find_cached_prefix(r)
    assert manager.allocate(r, 9) is not None
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.allocate(r, 1, hits)


def test_decode_starts_a_new_block(manager, make_request, admit, check_pool) -> None:
    r = make_request([1, 2, 3, 4, 5, 6, 7])
    admit(manager, r)
    r.num_computed_tokens = 7
    manager.cache_full_blocks(r)
    assert len(manager.req_to_blocks[r.request_id]) == 2
    assert len(manager.pool.cached) == 1
    r.append_output_token(8)  # fills block 1 in tokens, not yet computed
    assert len(r.block_hashes) == 2
    assert manager.allocate(r, 1) == []
    manager.cache_full_blocks(r)
    assert len(manager.pool.cached) == 1  # block 1 not computed yet: not published
    r.num_computed_tokens += 1
    manager.cache_full_blocks(r)
    assert len(manager.pool.cached) == 2
    r.append_output_token(9)  # the first token of block 2
    new = manager.allocate(r, 1)
    assert new is not None and len(new) == 1
    r.num_computed_tokens += 1
    manager.cache_full_blocks(r)
    assert len(manager.pool.cached) == 2 and new[0].block_hash is None
    # Output blocks are reusable prefixes (next chat turn).
    manager.free(r)
    nxt = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert manager.find_cached_prefix(nxt)[1] == 8
    assert_idle_and_clean(manager, check_pool)


def test_preempted_request_resumes_from_cache(manager, make_request, admit, check_pool) -> None:
    r = make_request(list(range(10)))
    assert r.num_cached_tokens == -1  # not looked up yet
    admit(manager, r)
    r.num_computed_tokens = 10
    manager.cache_full_blocks(r)
    for token in (10, 11, 12):
        r.append_output_token(token)
        assert manager.allocate(r, 1) is not None
        r.num_computed_tokens += 1
        manager.cache_full_blocks(r)
    r.append_output_token(13)  # sampled, not computed
    # Preempt by recompute.
    manager.free(r)
    r.num_computed_tokens = 0
    assert manager.num_free_blocks == manager.num_blocks
    hits, num = manager.find_cached_prefix(r)
    assert num == 12  # 14 tokens -> capped at 13 -> 3 blocks
    assert manager.allocate(r, r.num_tokens - num, hits) is not None
    r.num_computed_tokens = num
    assert r.num_tokens - r.num_computed_tokens == 2
    manager.free(r)
    assert_idle_and_clean(manager, check_pool)


# --- duplicates, eviction order ---------------------------------------------------------


def test_same_new_block_computed_twice_in_one_step(manager, make_request, admit,
                                                   check_pool) -> None:
    prompt = list(range(9))
    a, b = make_request(prompt), make_request(prompt)
    assert admit(manager, a) == 0 and admit(manager, b) == 0  # same step: neither cached
    for r in (a, b):
        r.num_computed_tokens = r.num_tokens
        manager.cache_full_blocks(r)
    check_pool(manager.pool)
    assert len(manager.pool.cached) == 2
    cached_ids = {blk.block_id for blk in manager.pool.cached.values()}
    assert cached_ids == {blk.block_id for blk in manager.req_to_blocks[a.request_id][:2]}
    # b's blocks hold the same KV but stay unhashed: exactly one cached copy.
    assert all(blk.block_hash is None for blk in manager.req_to_blocks[b.request_id])
    manager.free(a)
    manager.free(b)
    assert_idle_and_clean(manager, check_pool)
    c = make_request(prompt)
    assert admit(manager, c) == 8
    manager.free(c)
    assert_idle_and_clean(manager, check_pool)


def test_duplicate_then_evicting_first_copy_keeps_map_consistent(make_request, admit,
                                                                 check_pool) -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = make_request([1, 2, 3, 4, 5, 6, 7, 80, 9])  # same block 0, different block 1
    admit(manager, a)
    admit(manager, b)
    for r in (a, b):
        r.num_computed_tokens = r.num_tokens
        manager.cache_full_blocks(r)
    assert len(manager.pool.cached) == 3  # block 0 once, block 1 of each
    manager.free(a)
    filler = make_request([0] * 12)
    assert manager.allocate(filler, 12) is not None  # evicts a's blocks
    check_pool(manager.pool)
    # b's block 1 is still cached but unreachable without block 0: no hit, no crash.
    again = make_request([1, 2, 3, 4, 5, 6, 7, 80, 9])
    assert manager.find_cached_prefix(again) == ([], 0)
    manager.free(b)
    manager.free(filler)
    assert_idle_and_clean(manager, check_pool)


def test_eviction_deepest_first_shared_root_survives(make_request, run_prompt) -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    system = list(range(8))  # 2-block shared root
    a = make_request(system + [10, 11, 12, 13, 14])
    b = make_request(system + [20, 21, 22, 23, 24])
    run_prompt(manager, a)
    run_prompt(manager, b)
    manager.free(a)
    manager.free(b)
    root_hashes = a.block_hashes[:2]
    # Queue now: [b partial, a partial, a leaf, b leaf, root 1, root 0]. Need 3 blocks:
    # the 2 empty partial ones + 1 eviction, which must take a leaf.
    filler = make_request([0] * 12)
    assert manager.allocate(filler, 12) is not None
    for root in root_hashes:
        assert root in manager.pool.cached
    # Evict more: a's leaf went first (freed first), then b's, and the roots last.
    assert a.block_hashes[2] not in manager.pool.cached
    filler2 = make_request([1] * 4)
    assert manager.allocate(filler2, 4) is not None
    assert b.block_hashes[2] not in manager.pool.cached
    assert all(root in manager.pool.cached for root in root_hashes)
    filler3 = make_request([2] * 4)
    assert manager.allocate(filler3, 4) is not None
    # The deeper root block goes before the first one.
    assert root_hashes[0] in manager.pool.cached and root_hashes[1] not in manager.pool.cached


def test_eviction_emits_block_removed_and_stale_hash_never_hits(make_request, run_prompt) -> None:
    manager = KVCacheManager(num_blocks=3, block_size=BS, enable_events=True)
    a = make_request([1, 2, 3, 4, 5])
    run_prompt(manager, a)
    manager.free(a)
    manager.take_events()
    hog = make_request([9] * 12)
    assert manager.allocate(hog, 12) is not None  # reuses a's cached block
    events = manager.take_events()
    assert events == [BlockRemoved(a.block_hashes[0], events[0].block_id)]  # type: ignore[union-attr]
    assert manager.find_cached_prefix(make_request([1, 2, 3, 4, 5])) == ([], 0)


# --- events, reset, stats ---------------------------------------------------------------


def test_stored_events_chain_parents(manager, make_request, run_prompt) -> None:
    r = make_request(list(range(13)), cache_salt="t")
    run_prompt(manager, r)
    events = manager.take_events()
    assert all(isinstance(e, BlockStored) for e in events)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.block_hash for e in stored] == r.block_hashes
    assert [e.parent_hash for e in stored] == [None, *r.block_hashes[:2]]
    assert [e.token_ids for e in stored] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    ids = [b.block_id for b in manager.req_to_blocks[r.request_id][:3]]
    assert [e.block_id for e in stored] == ids
    # A hit stores nothing new.
    run_prompt(manager, make_request(list(range(13)), cache_salt="t"))
    assert manager.take_events() == []


def test_reset_prefix_cache(manager, make_request, run_prompt, check_pool) -> None:
    r = make_request(list(range(9)))
    run_prompt(manager, r)
    manager.take_events()
    assert manager.reset_prefix_cache() is False
    assert len(manager.pool.cached) == 2
    manager.free(r)
    assert manager.reset_prefix_cache() is True
    assert manager.take_events() == [AllBlocksCleared()]
    assert manager.pool.cached == {} and manager.stats().blocks_cached == 0
    assert manager.find_cached_prefix(make_request(list(range(9)))) == ([], 0)
    assert_idle_and_clean(manager, check_pool)


def test_stats(make_request, run_prompt) -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BS)
    s = manager.stats()
    assert (s.queries, s.hits, s.hit_rate, s.evictions, s.usage) == (0, 0, 0.0, 0, 0.0)
    a = make_request(list(range(10)))
    run_prompt(manager, a)
    s = manager.stats()
    assert (s.queries, s.hits, s.blocks_in_use, s.blocks_free, s.blocks_cached) == (10, 0, 3, 2, 2)
    assert s.usage == pytest.approx(0.6) and s.num_blocks == 5
    b = make_request(list(range(10)))
    run_prompt(manager, b)
    s = manager.stats()
    assert (s.queries, s.hits) == (20, 8) and s.hit_rate == pytest.approx(0.4)
    assert s.blocks_in_use == 4
    manager.free(a)
    manager.free(b)
    s = manager.stats()
    assert s.blocks_in_use == 0 and s.usage == 0.0 and s.blocks_cached == 2
    c = make_request([7] * 20)
    run_prompt(manager, c)
    assert manager.stats().evictions == 2 and manager.stats().blocks_cached == 5


def test_free_is_idempotent_per_request_and_pool_double_free_raises(
    manager, make_request, run_prompt, check_pool
) -> None:
    r = make_request(list(range(6)))
    run_prompt(manager, r)
    blocks = list(manager.req_to_blocks[r.request_id])
    manager.free(r)
    manager.free(r)  # e.g. abort racing with finish: a no-op, never a second decrement
    assert_idle_and_clean(manager, check_pool)
    with pytest.raises(ValueError, match="double free"):
        manager.pool.free(blocks)


# --- fork -------------------------------------------------------------------------------


def test_fork_partial_last_block_copy_on_write(manager, make_request, run_prompt,
                                              check_pool) -> None:
    parent = make_request(list(range(10)))
    run_prompt(manager, parent)
    pblocks = list(manager.req_to_blocks[parent.request_id])
    child = parent.fork("child", SamplingParams())
    free_before = manager.num_free_blocks
    copies = manager.fork(parent, child)
    cblocks = manager.req_to_blocks["child"]
    assert cblocks[:2] == pblocks[:2] and all(b.ref_count == 2 for b in pblocks[:2])
    assert cblocks[2] is not pblocks[2] and cblocks[2].ref_count == 1
    assert copies == [BlockCopy(src=pblocks[2].block_id, dst=cblocks[2].block_id)]
    assert manager.num_free_blocks == free_before - 1
    # They diverge; each writes only into its own last block.
    parent.append_output_token(100)
    child.append_output_token(200)
    for r in (parent, child):
        assert manager.allocate(r, 1) == []
    for r in (parent, child):
        r.num_computed_tokens = 11
        r.append_output_token(1)
        assert manager.allocate(r, 1) == []
        r.num_computed_tokens = 12
        manager.cache_full_blocks(r)
    assert child.block_hashes[2] != parent.block_hashes[2]
    assert manager.pool.get_cached_block(parent.block_hashes[2]) is pblocks[2]
    assert manager.pool.get_cached_block(child.block_hashes[2]) is cblocks[2]
    check_pool(manager.pool)
    manager.free(parent)
    manager.free(child)
    assert_idle_and_clean(manager, check_pool)


def test_fork_block_aligned_needs_no_copy(manager, make_request, run_prompt, check_pool) -> None:
    parent = make_request(list(range(8)))
    run_prompt(manager, parent)
    child = parent.fork("c", SamplingParams())
    free_before = manager.num_free_blocks
    assert manager.fork(parent, child) == []
    assert manager.num_free_blocks == free_before
    assert manager.req_to_blocks["c"] == manager.req_to_blocks[parent.request_id]
    parent.append_output_token(1)
    child.append_output_token(2)
    for r in (parent, child):
        new = manager.allocate(r, 1)
        assert new is not None and len(new) == 1
    assert manager.req_to_blocks["c"][2] is not manager.req_to_blocks[parent.request_id][2]
    manager.free(child)
    manager.free(parent)
    assert_idle_and_clean(manager, check_pool)


def test_fork_before_blocks_are_published(manager, make_request, admit, check_pool) -> None:
    parent = make_request(list(range(10)))
    admit(manager, parent)
    parent.num_computed_tokens = 10  # computed, cache_full_blocks not called yet
    child = parent.fork("c", SamplingParams())
    manager.fork(parent, child)
    manager.cache_full_blocks(child)
    manager.cache_full_blocks(parent)
    check_pool(manager.pool)
    assert len(manager.pool.cached) == 2
    manager.free(parent)
    manager.free(child)
    assert_idle_and_clean(manager, check_pool)


def test_fork_without_free_block_raises_and_changes_nothing(make_request, run_prompt) -> None:
    manager = KVCacheManager(num_blocks=3, block_size=BS)
    parent = make_request(list(range(10)))
    run_prompt(manager, parent)  # takes all 3 blocks
    child = parent.fork("c", SamplingParams())
    before = snapshot(manager)
    with pytest.raises(OutOfBlocksError):
        manager.fork(parent, child)
    assert snapshot(manager) == before and "c" not in manager.req_to_blocks


def test_fork_errors(manager, make_request, run_prompt) -> None:
    parent = make_request(list(range(6)))
    with pytest.raises(ValueError, match="no blocks"):
        manager.fork(parent, parent.fork("x", SamplingParams()))
    run_prompt(manager, parent)
    child = parent.fork("x", SamplingParams())
    manager.fork(parent, child)
    with pytest.raises(ValueError, match="already holds"):
        manager.fork(parent, child)


def test_request_fork_shares_no_mutable_state() -> None:
    hasher = BlockHasher(BS)
    parent = Request("p", list(range(6)), SamplingParams(), hasher, cache_salt="s")
    child = parent.fork("c", SamplingParams())
    child.append_output_token(6)
    child.append_output_token(7)
    assert parent.all_token_ids == list(range(6)) and len(parent.block_hashes) == 1
    assert child.block_hashes == hasher.hash_blocks(list(range(8)), cache_salt="s")


def test_prompt_logprobs_request_reads_the_cache_only_once_scored(manager, make_request,
                                                                  run_prompt) -> None:
    """Prompt logprobs need every prompt position's logits, which cached blocks lack: no
    hit, and no query in the hit rate. Once it has an output token (resumed after a
    preemption), its prompt was scored, and it hits like any other request."""
    from pagellm.core.sampling_params import SamplingParams

    prompt = list(range(3 * BS + 1))
    run_prompt(manager, make_request(prompt))
    queries = manager.stats().queries
    scoring = make_request(prompt)
    scoring.sampling_params = SamplingParams(prompt_logprobs=1)
    assert manager.max_hit_blocks(scoring) == 0
    assert manager.find_cached_prefix(scoring) == ([], 0)
    assert manager.allocate(scoring, scoring.num_tokens) is not None
    assert manager.stats().queries == queries
    manager.free(scoring)
    scoring.num_computed_tokens = 0
    scoring.append_output_token(7)
    assert manager.max_hit_blocks(scoring) == 3
    assert manager.find_cached_prefix(scoring)[1] == 3 * BS


def test_only_a_requests_first_lookup_counts_in_the_hit_rate(manager, make_request,
                                                             run_prompt) -> None:
    """A request resumed after preemption, or a sibling that waited for a seat (it has its
    first token), looks its prompt up again; vLLM keeps those lookups out of the hit rate,
    which would otherwise depend on the pool's size and max_num_seqs."""
    prompt = list(range(3 * BS + 1))
    run_prompt(manager, make_request(prompt))
    before = manager.stats()
    resumed = make_request(prompt)
    resumed.num_preemptions = 1
    waited = make_request(prompt)
    waited.append_output_token(7)
    for request in (resumed, waited):
        assert run_prompt(manager, request) == 3 * BS  # they still hit
        manager.free(request)
    after = manager.stats()
    assert (after.queries, after.hits) == (before.queries, before.hits)
    run_prompt(manager, make_request(prompt))
    assert manager.stats().hits == before.hits + 3 * BS


def test_departure_says_where_a_prompt_leaves_the_closest_cached_one(
        make_request, run_prompt, check_pool) -> None:
    """PITFALLS: a hit rate that is silently low (a template that renders an earlier turn
    differently) is found by where the prompt departs from what is cached."""
    manager = KVCacheManager(num_blocks=6, block_size=BS, index_children=True)
    first = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_prompt(manager, first)
    manager.free(first)
    near = make_request([1, 2, 3, 4, 5, 6, 0, 8, 9])  # parts in block 1, at token 6
    hits, _ = manager.find_cached_prefix(near)
    assert len(hits) == 1 and manager.departure(near, len(hits)) == 6
    assert manager.departure(make_request([0, 2, 3, 4, 5]), 0) == 0
    assert manager.departure(make_request([1, 2, 3, 4, 5], cache_salt="t"), 0) is None
    assert manager.departure(make_request([7, 7, 7, 7, 7, 7, 7, 7, 7]), 0) == 0
    same = make_request([1, 2, 3, 4, 5, 6, 7, 8])  # fully cached: capped, no departure
    assert manager.departure(same, len(manager.find_cached_prefix(same)[0])) is None
    hog = make_request([9] * 24)
    assert manager.allocate(hog, 24) is not None  # evicts every cached block
    assert manager.departure(near, 1) is None and manager.pool._children == {}
    check_pool(manager.pool)
    manager.free(hog)
    run_prompt(manager, first)
    manager.free(first)
    assert manager.reset_prefix_cache() and manager.pool._children == {}
    check_pool(manager.pool)


def compute_in_one_step(manager: KVCacheManager, admit, *requests: Request) -> None:
    """The requests are admitted, then all computed: none finds what another computes,
    and a block each of them computes is published once, the others' copies twins."""
    for request in requests:
        admit(manager, request)
    for request in requests:
        request.num_computed_tokens = request.num_tokens
        manager.cache_full_blocks(request)


def test_a_block_computed_twice_is_published_again_when_its_twin_is_evicted(
        make_request, admit, check_pool) -> None:
    """Two requests compute the same first block in one step; only a's copy is cached.
    a finishes and its copy is evicted while b still holds its own. When b's next block
    is published, b's own first block is published again first: the new block is never
    stored under a parent nobody can find (found by the stateful test)."""
    manager = KVCacheManager(num_blocks=6, block_size=BS, enable_events=True)
    prompt = [1, 2, 3, 4, 5, 6]
    a, b = make_request(prompt), make_request(prompt)
    compute_in_one_step(manager, admit, a, b)  # nothing cached yet: b computes block 0 too
    assert manager.pool.cached[a.block_hashes[0]].block_id == manager.get_block_ids(a)[0]
    manager.free(a)
    hog = make_request([9] * 16)
    assert manager.allocate(hog, 16) is not None  # every free block: a's copy of block 0 too
    assert a.block_hashes[0] not in manager.pool.cached
    manager.take_events()
    for token in (7, 8):  # b's second block fills and is published
        b.append_output_token(token)
    b.num_computed_tokens = b.num_tokens
    manager.cache_full_blocks(b)
    stored = manager.take_events()
    assert [e.block_hash for e in stored] == b.block_hashes[:2]  # type: ignore[union-attr]
    again = make_request([1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert manager.find_cached_prefix(again)[1] == 2 * BS
    check_pool(manager.pool)


def test_a_lost_grandparent_is_published_again_too(make_request, admit, check_pool) -> None:
    """As above, but b's second block was published (under a's first) before a's copy
    of the first block was evicted: it is b's first block that must come back when b's
    third block is published, not only a missing parent."""
    manager = KVCacheManager(num_blocks=8, block_size=BS, enable_events=True)
    a, b = make_request([1, 2, 3, 4, 50]), make_request([1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute_in_one_step(manager, admit, a, b)
    manager.free(a)
    hog = make_request([9] * 20)
    assert manager.allocate(hog, 20) is not None  # every free block: a's copy of block 0
    assert b.block_hashes[0] not in manager.pool.cached
    assert b.block_hashes[1] in manager.pool.cached
    for token in (10, 11, 12):  # b's third block fills
        b.append_output_token(token)
    b.num_computed_tokens = b.num_tokens
    manager.cache_full_blocks(b)
    again = make_request(list(range(1, 13)) + [0])
    assert manager.find_cached_prefix(again)[1] == 3 * BS
    manager.free(hog)
    manager.free(b)
    assert manager.find_cached_prefix(again)[1] == 3 * BS
    check_pool(manager.pool)


def test_a_twin_outliving_its_published_copy_is_published_when_freed(
        make_request, admit, check_pool) -> None:
    """As above, but b fills no new block after a's copy is evicted (it stops within its
    partly filled block): its twin is published when b is freed, not dropped with it
    (found by an outside exactness sweep: a prompt_logprobs request computes the prompt
    beside a plain one)."""
    manager = KVCacheManager(num_blocks=6, block_size=BS, enable_events=True)
    prompt = [1, 2, 3, 4, 5, 6]
    a, b = make_request(prompt), make_request(prompt)
    compute_in_one_step(manager, admit, a, b)
    manager.free(a)
    hog = make_request([9] * 16)
    assert manager.allocate(hog, 16) is not None  # a's copy of block 0 is evicted
    manager.free(hog)
    b.append_output_token(7)
    b.num_computed_tokens = b.num_tokens
    manager.cache_full_blocks(b)  # still within its second block: nothing new
    assert a.block_hashes[0] not in manager.pool.cached
    manager.take_events()
    b_first = manager.get_block_ids(b)[0]
    manager.free(b)
    assert [e.block_id for e in manager.take_events()] == [b_first]  # type: ignore[union-attr]
    assert manager.find_cached_prefix(make_request(prompt))[1] == BS
    assert_idle_and_clean(manager, check_pool)
