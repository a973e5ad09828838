"""Model-based test of the KV cache manager under scheduler-like random interleavings.

Besides the manager's own bookkeeping, the machine simulates the KV *content* of every
block: each slot records the (salt, adapter, token prefix) whose KV was written there. A
request only ever reads slots it has computed or been given, so any wrong sharing (a stale
hash, a shared partial block, a write into a cached or shared block, a missed copy-on-write,
a hit across tenants) shows up as a slot whose content is not what the request expects.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from pagellm.core.block_hash import BlockHash, BlockHasher
from pagellm.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagellm.core.kv_cache_manager import KVCacheManager, OutOfBlocksError
from pagellm.core.request import Request
from pagellm.core.sampling_params import SamplingParams

ALPHABET = 3
# Mostly no extra keys, so that prefixes are shared and hits are common.
EXTRA = st.sampled_from([(None, None), (None, None), (None, None), ("tenant-a", None),
                         ("tenant-b", None), (None, "lora")])
MAX_LIVE = 7

# What a KV slot holds: the extra keys and every token up to and including its own.
SlotKey = tuple[str | None, str | None, tuple[int, ...]]

PICK = st.integers(0, 1000)


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.params = SamplingParams()
        self.next_id = 0
        self.waiting: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        # Reference model.
        self.hash_key: dict[BlockHash, SlotKey] = {}  # every hash ever seen -> its prefix
        self.replayed: dict[BlockHash, int] = {}  # the cache map rebuilt from events
        self.stored: dict[BlockHash, list[SlotKey | None]] = {}  # content when cached
        self.parent_of: dict[BlockHash, BlockHash | None] = {}  # from BlockStored events
        self.held: dict[str, list[int]] = {}  # block ids each running request holds
        self.content: dict[int, list[SlotKey | None]] = {}

    # --- set-up -------------------------------------------------------------------------

    @initialize(
        block_size=st.integers(2, 4),
        num_blocks=st.integers(6, 16),
        algorithm=st.sampled_from(["sha256", "fast"]),
        bases=st.lists(
            st.lists(st.integers(0, ALPHABET - 1), min_size=12, max_size=12),
            min_size=1, max_size=2),
    )
    def setup(self, block_size: int, num_blocks: int, algorithm: str,
              bases: list[list[int]]) -> None:
        self.bs = block_size
        self.manager = KVCacheManager(num_blocks, block_size, enable_events=True,
                                      index_children=True)
        self.pool = self.manager.pool
        self.hasher = BlockHasher(block_size, algorithm)  # type: ignore[arg-type]
        self.bases = bases
        self.max_tokens = 5 * block_size
        self.content = {b: [None] * block_size for b in range(num_blocks)}

    # --- helpers ------------------------------------------------------------------------

    def key(self, req: Request, pos: int) -> SlotKey:
        return (req.cache_salt, req.adapter, tuple(req.all_token_ids[: pos + 1]))

    def learn_hashes(self, req: Request) -> None:
        """hash -> prefix for every full block: a hash must never name two prefixes."""
        for j, block_hash in enumerate(req.block_hashes):
            key = self.key(req, (j + 1) * self.bs - 1)
            assert self.hash_key.setdefault(block_hash, key) == key, "hash collision"

    def snapshot(self) -> tuple[object, ...]:
        pool = self.pool
        return (
            [(b.ref_count, b.block_hash) for b in pool.blocks],
            [b.block_id for b in pool.free_queue],
            dict(pool.cached),
            {r: [b.block_id for b in bl] for r, bl in self.manager.req_to_blocks.items()},
            dict(self.manager._num_cached_blocks),
            self.manager.stats(),
        )

    def check_readable(self, req: Request) -> None:
        """Every slot the request has computed (or was given) holds its own KV."""
        blocks = self.held[req.request_id]
        for pos in range(req.num_computed_tokens):
            slot = self.content[blocks[pos // self.bs]][pos % self.bs]
            assert slot == self.key(req, pos), f"{req} reads wrong KV at position {pos}"

    def take_events(self) -> None:
        for change in self.manager.take_events():
            if isinstance(change, BlockStored):
                assert change.block_hash not in self.replayed
                salt, adapter, prefix = self.hash_key[change.block_hash]
                assert change.token_ids == prefix[-self.bs:]
                if change.parent_hash is None:
                    assert len(prefix) == self.bs
                else:
                    assert self.hash_key[change.parent_hash] == (salt, adapter, prefix[:-self.bs])
                    # A block is never stored under an ancestor nobody can find: it
                    # would be unreachable, and an observer would hold an orphan.
                    ancestor: bytes | None = change.parent_hash
                    while ancestor is not None:
                        assert ancestor in self.replayed, "stored under an evicted ancestor"
                        ancestor = self.parent_of[ancestor]
                self.parent_of[change.block_hash] = change.parent_hash
                self.replayed[change.block_hash] = change.block_id
                self.stored[change.block_hash] = list(self.content[change.block_id])
            elif isinstance(change, BlockRemoved):
                assert self.replayed.pop(change.block_hash) == change.block_id
            else:
                assert isinstance(change, AllBlocksCleared)
                self.replayed.clear()

    def pick(self, pool: dict[str, Request], index: int) -> Request:
        return pool[sorted(pool)[index % len(pool)]]

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    # --- rules --------------------------------------------------------------------------
    # Few preconditions: a rule with nothing to act on falls back to adding a request, so
    # that hypothesis does not waste draws on disabled rules and runs stay busy.

    def add(self, base: int, cut: int, tail: list[int], extra: tuple[str | None, str | None]
            ) -> Request:
        # Small draws (which hypothesis favours) mean long shared prefixes.
        prompt = (self.bases[base % len(self.bases)][: 12 - cut] + tail)[: self.max_tokens - 2]
        if not prompt:
            prompt = [0]
        salt, adapter = extra
        req = Request(self.new_id(), prompt, self.params, self.hasher, cache_salt=salt,
                      adapter=adapter)
        assert req.block_hashes == self.hasher.hash_blocks(prompt, salt, adapter)
        assert req.num_cached_tokens == -1
        self.learn_hashes(req)
        self.waiting[req.request_id] = req
        return req

    def fallback_add(self, which: int, chunk: int) -> None:
        if len(self.waiting) + len(self.running) < MAX_LIVE:
            self.add(which, chunk % 13, [], (None, None))

    @rule(base=PICK, cut=st.integers(0, 12),
          tail=st.lists(st.integers(0, ALPHABET - 1), max_size=3), extra=EXTRA)
    def add_request(self, base: int, cut: int, tail: list[int],
                    extra: tuple[str | None, str | None]) -> None:
        if len(self.waiting) + len(self.running) < MAX_LIVE:
            self.add(base, cut, tail, extra)

    def find_and_allocate(self, req: Request, chunk: int) -> None:
        """Admission: look the prompt up, then allocate a first chunk with the hits."""
        hits, num_hit = self.manager.find_cached_prefix(req)
        assert num_hit == len(hits) * self.bs
        assert num_hit <= req.num_tokens - 1, "the last token must always be computed"
        # The hit is the longest run of the request's blocks present in the map.
        expected = 0
        for block_hash in req.block_hashes[: (req.num_tokens - 1) // self.bs]:
            if block_hash not in self.pool.cached:
                break
            expected += 1
        assert len(hits) == expected
        for j, block in enumerate(hits):
            assert block.block_hash == req.block_hashes[j]
        remaining = req.num_tokens - num_hit
        num_new = remaining - chunk % remaining  # a prefill chunk (small draw: all of it)
        revived = any(b.ref_count == 0 for b in hits)
        before = self.snapshot()
        new = self.manager.allocate(req, num_new, hits)
        if new is None:
            event("admission did not fit" + (" (with hits)" if hits else ""))
            assert self.snapshot() == before, "a failed allocation changed state"
            return
        if hits:
            event("prefix hit" + (" (revived cached-free)" if revived else ""))
        for block in new:
            assert block.ref_count == 1 and block.block_hash is None
        self.held[req.request_id] = [b.block_id for b in hits + new]
        assert len(self.held[req.request_id]) == -(-(num_hit + num_new) // self.bs)
        req.num_computed_tokens = num_hit
        req.num_cached_tokens = num_hit
        del self.waiting[req.request_id]
        self.running[req.request_id] = req
        self.check_readable(req)

    def compute(self, req: Request, chunk: int) -> None:
        """A prefill chunk (or the decode token): allocate, write the KV, publish."""
        start = req.num_computed_tokens
        n = req.num_tokens - start - chunk % (req.num_tokens - start)
        before = self.snapshot()
        new = self.manager.allocate(req, n)
        if new is None:
            event("chunk did not fit")
            assert self.snapshot() == before, "a failed allocation changed state"
            return
        for block in new:
            assert block.ref_count == 1 and block.block_hash is None
        self.held[req.request_id] += [b.block_id for b in new]
        self.check_readable(req)  # attention reads the whole computed prefix
        blocks = self.manager.req_to_blocks[req.request_id]
        for pos in range(start, start + n):
            block = blocks[pos // self.bs]
            # A request writes only into a block nobody else can see.
            assert block.ref_count == 1, f"write into shared {block}"
            assert block.block_hash is None, f"write into cached {block}"
            self.content[block.block_id][pos % self.bs] = self.key(req, pos)
        req.num_computed_tokens = start + n
        evictions = self.pool.num_evictions
        self.manager.cache_full_blocks(req)
        assert self.pool.num_evictions == evictions
        for index in range(start // self.bs, req.num_computed_tokens // self.bs):
            block, block_hash = blocks[index], req.block_hashes[index]
            if block.block_hash is None:
                # Only when another block already holds this hash (same block computed
                # twice in one step): the map keeps that one.
                assert block_hash in self.pool.cached
                event("same block computed twice (duplicate kept unhashed)")
            else:
                assert block.block_hash == block_hash

    def append_output(self, req: Request, token: int) -> None:
        """A sampled token: append it and make room for it (it is the next step's input)."""
        if req.num_tokens >= self.max_tokens:
            self.finish_request(req)
            return
        req.append_output_token(token)
        self.learn_hashes(req)
        before = self.snapshot()
        new = self.manager.allocate(req, 1)
        if new is None:
            event("decode did not fit")
            assert self.snapshot() == before
            return
        self.held[req.request_id] += [b.block_id for b in new]

    @rule(which=PICK, chunk=PICK)
    def step(self, which: int, chunk: int) -> None:
        """The scheduler's next action for one live request (finer interleavings)."""
        live = {**self.waiting, **self.running}
        if not live:
            self.fallback_add(which, chunk)
            return
        self.act(self.pick(live, which), chunk)

    def act(self, req: Request, chunk: int) -> None:
        if req.request_id in self.waiting:
            self.find_and_allocate(req, chunk)
        elif req.num_computed_tokens < req.num_tokens:
            self.compute(req, chunk)
        else:
            self.append_output(req, chunk % ALPHABET)

    @rule(
        arrival=st.none() | st.tuples(
            PICK, st.integers(0, 12), st.lists(st.integers(0, ALPHABET - 1), max_size=3),
            EXTRA),
        which=PICK,
        chunks=st.lists(PICK, min_size=MAX_LIVE, max_size=MAX_LIVE),
        disturbance=st.sampled_from(
            ["none", "none", "none", "fork", "preempt", "finish", "reset"]),
    )
    def engine_step(self, arrival: tuple[int, int, list[int], tuple[str | None, str | None]]
                    | None, which: int, chunks: list[int], disturbance: str) -> None:
        """One engine step: maybe an arrival, one action for every live request (in a
        rotated order, so that two admissions can precede both computes), maybe a fork,
        a preemption, a finish or a reset. Most examples are driven by this rule; the
        single-action rules below add finer interleavings."""
        if arrival is not None and len(self.waiting) + len(self.running) < MAX_LIVE:
            self.add(*arrival)
        ids = sorted({**self.waiting, **self.running})
        if not ids:
            self.fallback_add(which, chunks[0])
            return
        k = which % len(ids)
        for rid, chunk in zip(ids[k:] + ids[:k], chunks, strict=False):
            req = self.waiting.get(rid) or self.running.get(rid)
            if req is not None:  # else finished by an earlier action of this step
                self.act(req, chunk)
        if disturbance == "fork":
            self.fork(which)
        elif disturbance == "preempt":
            self.preempt(which)
        elif disturbance == "finish":
            self.finish(which)
        elif disturbance == "reset":
            self.reset_prefix_cache()

    @rule(which=PICK)
    def fork(self, which: int) -> None:
        candidates = {k: r for k, r in self.running.items() if r.num_computed_tokens > 0}
        if not candidates or len(self.waiting) + len(self.running) >= MAX_LIVE:
            return
        parent = self.pick(candidates, which)
        child = parent.fork(self.new_id(), self.params)
        num_full, partial = divmod(parent.num_computed_tokens, self.bs)
        before = self.snapshot()
        try:
            copies = self.manager.fork(parent, child)
        except OutOfBlocksError:
            event("fork out of blocks")
            assert partial and self.pool.num_free_blocks == 0
            assert self.snapshot() == before
            return
        parent_ids = self.held[parent.request_id]
        child_ids = self.manager.get_block_ids(child)
        assert child_ids[:num_full] == parent_ids[:num_full]
        assert len(child_ids) == num_full + (1 if partial else 0)
        assert len(copies) == (1 if partial else 0)
        event(f"fork with {len(copies)} copies")
        for copy in copies:
            assert copy.src == parent_ids[num_full] and copy.dst == child_ids[num_full]
            assert self.pool.blocks[copy.dst].ref_count == 1
            self.content[copy.dst] = list(self.content[copy.src])
        self.held[child.request_id] = child_ids
        self.running[child.request_id] = child
        self.check_readable(child)

    @rule(which=PICK)
    def preempt(self, which: int) -> None:
        if not self.running:
            return
        req = self.pick(self.running, which)
        self.manager.free(req)
        del self.held[req.request_id]
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        del self.running[req.request_id]
        self.waiting[req.request_id] = req
        event("preempted")

    def finish_request(self, req: Request) -> None:
        self.manager.free(req)
        self.held.pop(req.request_id, None)
        self.running.pop(req.request_id, None)
        self.waiting.pop(req.request_id, None)

    @rule(which=PICK)
    def finish(self, which: int) -> None:
        live = {**self.waiting, **self.running}
        if live:
            self.finish_request(self.pick(live, which))

    @rule()
    def reset_prefix_cache(self) -> None:
        if self.pool.num_used_blocks:
            before = self.snapshot()
            assert self.manager.reset_prefix_cache() is False
            event("reset refused")
            assert self.snapshot() == before
            return
        event("reset" + (" (non-empty cache)" if self.pool.cached else ""))
        assert self.manager.reset_prefix_cache() is True
        assert self.pool.cached == {}

    # --- invariants ---------------------------------------------------------------------

    @invariant()
    def events_replay_to_the_map(self) -> None:
        if not hasattr(self, "manager"):
            return
        self.take_events()
        assert self.replayed == {h: b.block_id for h, b in self.pool.cached.items()}

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "manager"):
            return
        pool, manager = self.pool, self.manager
        assert set(manager.req_to_blocks) == set(self.running)
        assert {r: manager.get_block_ids(req) for r, req in self.running.items()} == self.held
        holders = Counter(b for ids in self.held.values() for b in ids)
        queue = [b.block_id for b in pool.free_queue]
        assert len(queue) == len(set(queue)) == pool.num_free_blocks
        in_queue = set(queue)
        for block in pool.blocks:
            assert block.ref_count == holders[block.block_id], block
            assert (block.block_id in in_queue) == (block.ref_count == 0), block
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        if pool.num_evictions:
            event("evictions happened")
        if len(self.running) >= 2 and pool.num_free_blocks == 0:
            event("pool full")
        if not self.running:
            assert pool.num_free_blocks == pool.num_blocks
            assert all(b.ref_count == 0 for b in pool.blocks)

    @invariant()
    def cache_map_is_consistent_and_correct(self) -> None:
        if not hasattr(self, "manager"):
            return
        self.take_events()  # records what each newly stored block held
        for block_hash, block in self.pool.cached.items():
            assert block.block_hash == block_hash
            # Its slots hold exactly the KV its hash names (and so never change while cached).
            salt, adapter, prefix = self.hash_key[block_hash]
            base = len(prefix) - self.bs
            expected = [(salt, adapter, prefix[: base + s + 1]) for s in range(self.bs)]
            assert self.content[block.block_id] == expected, f"{block} holds other KV"
            assert self.content[block.block_id] == self.stored[block_hash], "changed in cache"
        for block in self.pool.blocks:
            if block.block_hash is not None:
                assert self.pool.cached.get(block.block_hash) is block

    @invariant()
    def running_requests_read_their_own_kv(self) -> None:
        for req in self.running.values():
            self.check_readable(req)


TestKVCacheStateful = KVCacheMachine.TestCase
TestKVCacheStateful.settings = settings(
    max_examples=500,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
