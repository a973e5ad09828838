"""Model-based test of the scheduler driven like the engine, with a fake model.

Random arrivals (prompts from a small alphabet with shared prefixes, random max_tokens,
n in 1..3, random salts, stop conditions), random aborts, and small random pools and
budgets (so that preemption, fork failures and evictions are common) interleave with
engine steps. Every request admitted from the waiting queue (fresh, resumed after a
preemption, or a sibling whose fork found no block) must get exactly the prefix-cache hit
that the pool could serve it. The fake model also keeps the KV *content* of every slot:
each write records the (salt, token prefix) whose KV it is, block copies are applied
before the forward pass, and every request checks that the slots it attends to hold its
own prefix. At the end of each example the engine is stepped until idle (a hang fails),
then the leak check and the token counts are checked.
"""

from __future__ import annotations

import zlib
from collections import Counter
from itertools import takewhile

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagellm.core.block_hash import BlockHash, BlockHasher
from pagellm.core.block_pool import KVBlock
from pagellm.core.config import SchedulerConfig
from pagellm.core.events import BlockRemoved
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sampling_params import SamplingParams
from pagellm.core.scheduler import Scheduler, SchedulerOutput

ALPHABET = 3
EOS = 3  # the fake model emits it now and then
STOP = 2  # a stop_token_id some requests use
MAX_LIVE = 8
PICK = st.integers(0, 1000)

SlotKey = tuple[str | None, tuple[int, ...]]


def fake_token(request_id: str, length: int) -> int:
    """The token sampled for a request of this length; EOS about one time in eight."""
    value = zlib.crc32(f"{request_id}:{length}".encode())
    return EOS if value % 8 == 0 else value % ALPHABET


class EvictionLoggingKVCacheManager(KVCacheManager):
    """The real manager, noting for each `allocate` which hashes the pool evicted earlier
    in the step (from its events). Within `schedule()` the cached map only loses entries,
    to the evictions of allocations, so a request's look-up, which `allocate` must directly
    follow, saw the map of the step's start less `evicted_before[request_id]`."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        super().__init__(num_blocks, block_size, enable_caching, enable_events=True)
        self.evicted: set[BlockHash] = set()
        self.evicted_before: dict[str, frozenset[BlockHash]] = {}

    def start_step(self) -> None:
        self.take_events()
        self.evicted.clear()
        self.evicted_before.clear()

    def allocate(self, request: Request, num_new_tokens: int,
                 cached_blocks: list[KVBlock] | None = None,
                 reserve: int = 0) -> list[KVBlock] | None:
        self.evicted_before[request.request_id] = frozenset(self.evicted)
        new = super().allocate(request, num_new_tokens, cached_blocks, reserve)
        self.evicted.update(e.block_hash for e in self.take_events()
                            if isinstance(e, BlockRemoved))
        return new


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([2, 4]),
        num_blocks=st.integers(3, 14),
        max_model_len=st.integers(6, 40),
        budget=st.integers(1, 24),
        max_num_seqs=st.integers(1, 6),
        policy=st.sampled_from(["fcfs", "cache_aware", "priority"]),
        window=st.sampled_from([1, 2, 64]),
        threshold=st.sampled_from([0, 0, 2, 5]),
        caching=st.sampled_from([True, True, True, False]),
        bases=st.lists(st.lists(st.integers(0, ALPHABET - 1), min_size=16, max_size=16),
                       min_size=1, max_size=2),
    )
    def setup(self, block_size: int, num_blocks: int, max_model_len: int, budget: int,
              max_num_seqs: int, policy: str, window: int, threshold: int, caching: bool,
              bases: list[list[int]]) -> None:
        self.bs = block_size
        self.kv = EvictionLoggingKVCacheManager(num_blocks, block_size, caching)
        self.config = SchedulerConfig(max_model_len=max_model_len,
                                      max_num_batched_tokens=budget,
                                      max_num_seqs=max_num_seqs,
                                      policy=policy,  # type: ignore[arg-type]
                                      cache_aware_window=window,
                                      long_prefill_token_threshold=threshold)
        self.sched = Scheduler(self.config, self.kv)
        self.hasher = BlockHasher(block_size)
        self.bases = bases
        self.limit = self.sched.max_seq_len
        self.next_id = 0
        self.all: dict[str, Request] = {}
        self.aborted: set[str] = set()
        self.first_cached: dict[str, int] = {}
        self.hash_key: dict[BlockHash, SlotKey] = {}
        self.content: dict[int, list[SlotKey | None]] = {
            b: [None] * block_size for b in range(num_blocks)}
        self.steps = 0

    # --- helpers ------------------------------------------------------------------------

    def key(self, req: Request, pos: int) -> SlotKey:
        return (req.cache_salt, tuple(req.all_token_ids[: pos + 1]))

    def learn_hashes(self, req: Request) -> None:
        for j, block_hash in enumerate(req.block_hashes):
            key = self.key(req, (j + 1) * self.bs - 1)
            assert self.hash_key.setdefault(block_hash, key) == key, "hash collision"

    def live_ids(self) -> list[str]:
        return sorted(self.sched.requests)

    # --- rules ----------------------------------------------------------------------------

    @rule(base=PICK, cut=st.integers(0, 16),
          tail=st.lists(st.integers(0, ALPHABET - 1), max_size=4),
          max_tokens=st.none() | st.integers(1, 10), n=st.integers(1, 3),
          salt=st.sampled_from([None, None, "tenant"]),
          ignore_eos=st.booleans(), stop=st.booleans(), min_tokens=st.integers(0, 3),
          priority=st.integers(-2, 2),
          reads=st.sampled_from(["cache", "cache", "cache", "skip", "prompt_logprobs"]))
    def add_request(self, base: int, cut: int, tail: list[int], max_tokens: int | None,
                    n: int, salt: str | None, ignore_eos: bool, stop: bool,
                    min_tokens: int, priority: int, reads: str) -> None:
        if len(self.sched.requests) >= MAX_LIVE:
            return
        prompt = (self.bases[base % len(self.bases)][: 16 - cut] + tail)[: self.limit - 1]
        if not prompt:
            prompt = [0]
        if max_tokens is not None:
            min_tokens = min(min_tokens, max_tokens)
        params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                stop_token_ids=[STOP] if stop else None,
                                min_tokens=min_tokens,
                                skip_reading_prefix_cache=True if reads == "skip" else None,
                                prompt_logprobs=1 if reads == "prompt_logprobs" else None)
        self.next_id += 1
        rid = f"r{self.next_id}"
        leader_params = params if n == 1 else params.for_child(0)
        leader = Request(rid, prompt, leader_params, self.hasher, frozenset({EOS}),
                         cache_salt=salt, priority=priority)
        siblings = [leader.fork(f"{rid}#{i}", params.for_child(i)) for i in range(1, n)]
        self.sched.add_request(leader, siblings)
        for req in [leader, *siblings]:
            self.all[req.request_id] = req
            self.learn_hashes(req)

    @rule(which=PICK)
    def abort(self, which: int) -> None:
        live = self.live_ids()
        if not live:
            return
        rid = live[which % len(live)]
        req = self.all[rid]
        event(f"abort {req.status.name.lower()}")
        group = [r for r in live if r == rid or r.startswith(rid + "#")]
        self.sched.finish(req, RequestStatus.FINISHED_ABORTED)
        assert req.status is RequestStatus.FINISHED_ABORTED
        self.aborted.add(rid)
        if "#" not in rid:
            for other in group:  # a leader's pending siblings end with it
                if self.all[other].is_finished:
                    self.aborted.add(other)
        assert rid not in self.sched.requests and rid not in self.kv.req_to_blocks

    @rule(kind=st.integers(0, 5))
    def reset_prefix_cache(self, kind: int) -> None:
        """Now and then (a reset every step would leave little to hit): refused, with
        nothing changed, while any block is held, as in vLLM; or, with vLLM's
        reset_running_requests, every running request preempted first, so that it
        succeeds and they recompute and go on."""
        if kind == 0:
            held = self.kv.pool.num_used_blocks
            assert self.kv.reset_prefix_cache() == (held == 0)
        elif kind == 1:
            self.sched.preempt_running()
            assert self.kv.reset_prefix_cache()
            assert not self.kv.pool.cached
            event("reset with running requests preempted")

    @rule()
    def step(self) -> None:
        self.engine_step()

    @rule(k=st.integers(2, 6))
    def steps(self, k: int) -> None:
        for _ in range(k):
            self.engine_step()

    # --- the fake engine ---------------------------------------------------------------

    def engine_step(self) -> SchedulerOutput:
        waiting_before = {r.request_id for r in self.sched.waiting}
        cached_before = set(self.kv.pool.cached)
        self.kv.start_step()
        out = self.sched.schedule()
        self.steps += 1
        self.check_schedule(out, waiting_before, cached_before)
        self.forward(out)
        sampled: dict[str, int] = {}
        for item in out.scheduled:
            if item.samples:
                for target in [item.request, *item.forks]:
                    sampled[target.request_id] = fake_token(target.request_id,
                                                            target.num_tokens)
        for req in self.sched.update_from_output(out, sampled):
            assert req.request_id in sampled
            self.learn_hashes(req)
        if out.preempted:
            event("preemption")
        for item in out.scheduled:
            if any(child in self.sched.waiting for child in item.forks):
                event("fork sent to waiting (no block or seat)")
        if out.block_copies:
            event("copy-on-write")
        return out

    def check_schedule(self, out: SchedulerOutput, waiting_before: set[str],
                       cached_before: set[BlockHash]) -> None:
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(self.sched.running) <= self.config.max_num_seqs
        ids = [s.request.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids))
        # Hashes of the blocks that the requests scheduled so far fill in this step.
        in_flight: set[BlockHash] = set()
        for item in out.scheduled:
            req = item.request
            assert req.status is RequestStatus.RUNNING and req in self.sched.running
            assert item.num_new_tokens >= 1
            if self.config.long_prefill_token_threshold and len(self.sched.requests) > 1:
                assert item.num_new_tokens <= self.config.long_prefill_token_threshold
            end = req.num_computed_tokens + item.num_new_tokens
            assert end <= req.num_tokens and item.samples == (end == req.num_tokens)
            assert not item.forks or item.samples
            blocks = self.kv.req_to_blocks[req.request_id]
            assert len(blocks) == -(-end // self.bs)
            if req.request_id in waiting_before:
                # Admitted now: what counts as computed is a genuine hit, looked up now.
                hit = req.num_computed_tokens
                self.check_hit(req, cached_before, in_flight)
                for j in range(hit // self.bs):
                    assert blocks[j].block_hash == req.block_hashes[j]
                if not req.num_preemptions and "#" not in req.request_id:
                    assert req.num_cached_tokens == hit  # recorded at first admission
                first = self.first_cached.setdefault(req.request_id, req.num_cached_tokens)
                assert req.num_cached_tokens == first >= 0
                if req.num_preemptions:
                    event("resumed after preemption" + (" with a hit" if hit else ""))
            if self.kv.enable_caching:
                in_flight.update(req.block_hashes[req.num_computed_tokens // self.bs:
                                                  end // self.bs])
        for req in out.preempted:
            assert req.status is RequestStatus.PREEMPTED and req.num_computed_tokens == 0
            assert req.request_id not in self.kv.req_to_blocks

    def check_hit(self, req: Request, cached_before: set[BlockHash],
                  in_flight: set[BlockHash]) -> None:
        """The hit of a request admitted from the waiting queue is the longest run of its
        blocks that its look-up could find: cached when schedule() began and not evicted
        since by the step's earlier allocations (nothing is published during schedule(),
        so a block that an earlier request computes in this step is not a hit yet). The
        run is capped below the last token, which is always computed; for a request
        resumed after a preemption that is the last of its prompt and outputs, and the
        run is looked up anew, not taken from its first admission.

        A request does not miss on a block in flight: it waits a step, to hit it then,
        unless the cache-aware policy has let it be overtaken too often (the admitted
        request's `num_overtaken` no longer changes after its admission).
        """
        params = req.sampling_params
        if ((params.skip_reading_prefix_cache or params.prompt_logprobs is not None)
                and not req.num_output_tokens):
            # Its whole prompt is computed (prompt logprobs need every position's logits);
            # once it has an output (a resume), it reads the cache like any other.
            assert req.num_computed_tokens == 0, f"{req} read the cache it must skip"
            return
        findable = cached_before - self.kv.evicted_before[req.request_id]
        hashes = req.block_hashes[: (req.num_tokens - 1) // self.bs]
        run = len(list(takewhile(findable.__contains__, hashes)))
        assert req.num_computed_tokens == run * self.bs, (
            f"{req} admitted with {req.num_computed_tokens} tokens computed, "
            f"but {run} of its blocks were cached")
        if run < len(list(takewhile(cached_before.__contains__, hashes))):
            event("hit shortened by an eviction in the same step")
        if run < len(hashes) and hashes[run] in in_flight:
            assert (self.config.policy == "cache_aware"
                    and req.num_overtaken >= self.config.cache_aware_window), (
                f"{req} misses on block {run}, which is computed in this step")
            event("overdue: admitted despite an in-flight block")

    def forward(self, out: SchedulerOutput) -> None:
        """The model's side of a step: copies first, then each request attends to its
        computed prefix and writes the KV of its new tokens."""
        for copy in out.block_copies:
            self.content[copy.dst] = list(self.content[copy.src])
        for item in out.scheduled:
            req = item.request
            blocks = self.kv.req_to_blocks[req.request_id]
            start = req.num_computed_tokens
            for pos in range(start):
                slot = self.content[blocks[pos // self.bs].block_id][pos % self.bs]
                assert slot == self.key(req, pos), f"{req} reads wrong KV at {pos}"
            for pos in range(start, start + item.num_new_tokens):
                block = blocks[pos // self.bs]
                assert block.ref_count == 1, f"{req} writes into shared {block}"
                assert block.block_hash is None, f"{req} writes into cached {block}"
                self.content[block.block_id][pos % self.bs] = self.key(req, pos)

    # --- invariants ---------------------------------------------------------------------

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "sched"):
            return
        sched, kv, pool = self.sched, self.kv, self.kv.pool
        running = {r.request_id for r in sched.running}
        waiting = [r.request_id for r in sched.waiting]
        pending = [s.request_id for sibs in sched._siblings.values() for s in sibs]
        assert len(running) == len(sched.running) and len(waiting) == len(set(waiting))
        assert not running & set(waiting), "a request both waiting and running"
        assert sorted([*running, *waiting, *pending]) == sorted(sched.requests)
        assert len(sched.running) <= self.config.max_num_seqs
        for req in sched.running:
            assert req.status is RequestStatus.RUNNING
            # Its blocks cover exactly its computed tokens.
            assert len(kv.req_to_blocks[req.request_id]) == -(-req.num_computed_tokens
                                                              // self.bs)
        for req in sched.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert req.num_computed_tokens == 0
            if self.config.policy == "cache_aware":
                assert req.num_overtaken <= self.config.cache_aware_window
        assert set(kv.req_to_blocks) == running
        holders = Counter(b.block_id for bl in kv.req_to_blocks.values() for b in bl)
        queue = {b.block_id for b in pool.free_queue}
        for block in pool.blocks:
            assert block.ref_count == holders[block.block_id], block
            assert (block.block_id in queue) == (block.ref_count == 0), block
        for block_hash, block in pool.cached.items():
            assert block.block_hash == block_hash
            # A cached block holds exactly the KV its hash names.
            salt, prefix = self.hash_key[block_hash]
            base = len(prefix) - self.bs
            expected = [(salt, prefix[: base + s + 1]) for s in range(self.bs)]
            assert self.content[block.block_id] == expected, f"{block} holds other KV"
        for rid, req in self.all.items():
            assert req.is_finished == (rid not in sched.requests)
        if not sched.has_unfinished_requests():
            self.check_idle()

    def check_idle(self) -> None:
        """The leak check."""
        pool = self.kv.pool
        assert not self.sched.running and not self.sched.waiting and not self.sched._siblings
        assert self.kv.req_to_blocks == {}
        assert pool.num_free_blocks == pool.num_blocks
        assert all(b.ref_count == 0 for b in pool.blocks)

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        bound = 50 + 4 * sum(r.num_prompt_tokens + self.limit for r in self.all.values())
        for _ in range(bound):
            if not self.sched.has_unfinished_requests():
                break
            self.engine_step()
            self.accounting()
        assert not self.sched.has_unfinished_requests(), f"hang: {self.sched.requests}"
        self.check_idle()
        for rid, req in self.all.items():
            self.check_outputs(rid, req)

    def check_outputs(self, rid: str, req: Request) -> None:
        params = req.sampling_params
        expected = self.limit - req.num_prompt_tokens
        if params.max_tokens is not None:
            expected = min(expected, params.max_tokens)
        # Each token was sampled once, at its length (a preempted request recomputes, it
        # does not resample).
        assert req.output_token_ids == [
            fake_token(rid, req.num_prompt_tokens + k) for k in range(req.num_output_tokens)]

        def stops(k: int, token: int) -> bool:
            if k + 1 < params.min_tokens:
                return False
            return token in params.stop_token_ids or (
                not params.ignore_eos and token in req.eos_token_ids)

        assert not any(stops(k, t) for k, t in enumerate(req.output_token_ids[:-1]))
        if rid in self.aborted:
            assert req.status is RequestStatus.FINISHED_ABORTED
            assert req.num_output_tokens <= expected
            event("aborted")
        elif req.status is RequestStatus.FINISHED_STOPPED:
            assert 1 <= req.num_output_tokens <= expected
            last = req.output_token_ids[-1]
            assert stops(req.num_output_tokens - 1, last)
            assert req.stop_reason == (last if last in params.stop_token_ids else None)
            event("stopped")
        else:
            assert req.status is RequestStatus.FINISHED_LENGTH, req.status
            assert req.num_output_tokens == expected, (rid, req.num_output_tokens, expected)


TestSchedulerStateful = SchedulerMachine.TestCase
TestSchedulerStateful.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
