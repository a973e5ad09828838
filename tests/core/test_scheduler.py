"""Scheduler: continuous batching, chunked prefill, prefix hits, preemption, n > 1, stops.

The scheduler is driven here as the engine drives it, with a fake model in place of the
worker: after each `schedule()`, every ScheduledRequest that samples (and each of its
forks) gets a token, chosen by a deterministic function of the request id and its length
unless a test scripts it, and `update_from_output` is called. The driver checks the
per-step invariants (budget, seats, what samples) on every step of every test.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.core.block_hash import BlockHasher
from pagellm.core.config import SchedulerConfig
from pagellm.core.kv_cache_manager import BlockCopy, KVCacheManager
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sampling_params import SamplingParams
from pagellm.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

BS = 4
EOS = 99
VOCAB = 50  # fake-model tokens are < VOCAB, so never EOS unless a test scripts it


def fake_token(request: Request) -> int:
    """The fake model's next token: deterministic in the request id and its length."""
    return zlib.crc32(f"{request.request_id}:{request.num_tokens}".encode()) % VOCAB


class Driver:
    """A scheduler plus a fake model; `step()` is one engine step."""

    def __init__(
        self,
        num_blocks: int = 64,
        *,
        block_size: int = BS,
        max_model_len: int = 1024,
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 16,
        policy: str = "fcfs",
        enable_caching: bool = True,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching)
        self.bs = block_size
        self.config = SchedulerConfig(
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            policy=policy,  # type: ignore[arg-type]
            long_prefill_token_threshold=long_prefill_token_threshold,
        )
        self.sched = Scheduler(self.config, self.kv)
        self.hasher = BlockHasher(block_size)
        self.token_fn: Callable[[Request], int] = fake_token
        self.outputs: list[SchedulerOutput] = []
        self.all: dict[str, Request] = {}

    def add(self, rid: str, prompt: list[int], salt: str | None = None, priority: int = 0,
            **params: object) -> list[Request]:
        """Adds a request as the engine does (n > 1: a leader plus forked siblings)."""
        sp = SamplingParams(**params)  # type: ignore[arg-type]
        leader_params = sp if sp.n == 1 else sp.for_child(0)
        leader = Request(rid, prompt, leader_params, self.hasher, frozenset({EOS}),
                         cache_salt=salt, priority=priority)
        siblings = [leader.fork(f"{rid}#{i}", sp.for_child(i)) for i in range(1, sp.n)]
        self.sched.add_request(leader, siblings)
        for r in [leader, *siblings]:
            self.all[r.request_id] = r
        return [leader, *siblings]

    def step(self, tokens: dict[str, int] | None = None) -> SchedulerOutput:
        out = self.sched.schedule()
        self.check_scheduled(out)
        sampled: dict[str, int] = {}
        for item in out.scheduled:
            if item.samples:
                for target in [item.request, *item.forks]:
                    token = (tokens or {}).get(target.request_id)
                    sampled[target.request_id] = (
                        self.token_fn(target) if token is None else token)
        self.sched.update_from_output(out, sampled)
        self.check_accounting()
        self.outputs.append(out)
        return out

    def run(self, max_steps: int = 1000) -> int:
        for steps in range(max_steps):
            if not self.sched.has_unfinished_requests():
                self.check_idle()
                return steps
            self.step()
        raise AssertionError(f"not idle after {max_steps} steps: {self.sched.requests}")

    # --- invariants ----------------------------------------------------------------------

    def check_scheduled(self, out: SchedulerOutput) -> None:
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(self.sched.running) <= self.config.max_num_seqs
        ids = [s.request.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids))
        for item in out.scheduled:
            req = item.request
            assert item.num_new_tokens >= 1
            assert req.status is RequestStatus.RUNNING and req in self.sched.running
            end = req.num_computed_tokens + item.num_new_tokens
            assert end <= req.num_tokens
            assert item.samples == (end == req.num_tokens)
            assert not item.forks or item.samples
            held = self.kv.get_block_ids(req)
            assert len(held) == -(-end // self.bs), "blocks must cover the scheduled tokens"
        for req in out.preempted:
            assert req.status is RequestStatus.PREEMPTED and req in self.sched.waiting
            assert req.request_id not in self.kv.req_to_blocks

    def check_accounting(self) -> None:
        running_ids = {r.request_id for r in self.sched.running}
        assert set(self.kv.req_to_blocks) == running_ids
        assert not running_ids & {r.request_id for r in self.sched.waiting}
        holders = Counter(b.block_id for bl in self.kv.req_to_blocks.values() for b in bl)
        for block in self.kv.pool.blocks:
            assert block.ref_count == holders[block.block_id], block
        for req in self.sched.running:
            assert len(self.kv.get_block_ids(req)) == -(-req.num_computed_tokens // self.bs)

    def check_idle(self) -> None:
        """The leak check."""
        assert not self.sched.running and not self.sched.waiting
        assert self.sched.num_waiting == 0
        assert self.kv.req_to_blocks == {}
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert all(b.ref_count == 0 for b in self.kv.pool.blocks)

    def scheduled_of(self, out: SchedulerOutput, rid: str) -> ScheduledRequest | None:
        return next((s for s in out.scheduled if s.request.request_id == rid), None)


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


# --- continuous batching ----------------------------------------------------------------


def test_budget_and_seats_are_respected_and_everything_completes() -> None:
    d = Driver(num_blocks=256, max_num_batched_tokens=10, max_num_seqs=3)
    lengths = [3, 17, 1, 9, 25, 4, 12, 2]
    for i, n in enumerate(lengths):
        d.add(f"r{i}", prompt_of(i, n), max_tokens=5)
    steps = d.run()
    for out in d.outputs:
        assert out.num_batched_tokens <= 10
    assert max(len(o.scheduled) for o in d.outputs) == 3
    assert any(o.num_batched_tokens == 10 for o in d.outputs), "the budget is used fully"
    for i, n in enumerate(lengths):
        r = d.all[f"r{i}"]
        assert r.num_output_tokens == 5 and r.status is RequestStatus.FINISHED_LENGTH
        assert r.status.finish_reason == "length"
        assert r.output_token_ids == [
            zlib.crc32(f"r{i}:{n + k}".encode()) % VOCAB for k in range(5)]
    total = sum(lengths) + 5 * len(lengths) - len(lengths)  # the last token is never run
    assert sum(o.num_batched_tokens for o in d.outputs) == total  # nothing computed twice
    assert steps >= total / 10


def test_waiting_request_is_admitted_as_soon_as_a_seat_frees() -> None:
    d = Driver(max_num_seqs=1)
    d.add("a", [1, 2, 3], max_tokens=2)
    d.add("b", [4, 5, 6], max_tokens=2)
    assert [s.request.request_id for s in d.step().scheduled] == ["a"]
    assert [s.request.request_id for s in d.step().scheduled] == ["a"]  # a finishes
    assert d.all["a"].is_finished
    assert [s.request.request_id for s in d.step().scheduled] == ["b"]
    d.run()


def test_chunked_prefill_samples_only_on_the_last_chunk() -> None:
    d = Driver(max_num_batched_tokens=8)
    (r,) = d.add("long", prompt_of(1, 23), max_tokens=3)
    chunks = []
    for _ in range(3):
        item = d.step().scheduled[0]
        chunks.append((item.num_new_tokens, item.samples))
        assert r.num_output_tokens == (1 if item.samples else 0)
    assert chunks == [(8, False), (8, False), (7, True)]
    assert r.num_computed_tokens == 23 and r.num_tokens == 24
    # Full blocks are published chunk by chunk.
    assert all(h in d.kv.pool.cached for h in r.block_hashes[:5])
    d.run()
    assert r.num_output_tokens == 3


def test_decodes_go_first_and_a_prompt_takes_the_rest_of_the_budget() -> None:
    d = Driver(max_num_batched_tokens=6)
    d.add("a", [1, 2], max_tokens=10)
    d.step()
    d.add("b", prompt_of(2, 14), max_tokens=2)
    out = d.step()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 1), ("b", 5)]
    out = d.step()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 1), ("b", 5)]
    out = d.step()
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled] == [
        ("a", 1, True), ("b", 4, True)]
    d.run()


def test_a_long_prefill_leaves_room_for_requests_arriving_meanwhile() -> None:
    """vLLM's long_prefill_token_threshold: a long prompt computes at most that many
    tokens a step, and the rest of the budget admits and serves the newcomers, who
    otherwise wait for its whole prefill (a 4,000-token prompt held the step budget for
    13 s under load)."""
    capped = Driver(max_num_batched_tokens=16, long_prefill_token_threshold=6)
    (long,) = capped.add("long", prompt_of(3, 60), max_tokens=2)
    first = capped.step()  # alone, it starves nobody: the whole budget, as in vLLM
    assert [(s.request.request_id, s.num_new_tokens) for s in first.scheduled] == [
        ("long", 16)]
    capped.add("short", prompt_of(4, 9), max_tokens=3)
    out = capped.step()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("long", 6), ("short", 6)]  # the cap is every request's, as in vLLM
    out = capped.step()
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled] == [
        ("long", 6, False), ("short", 3, True)]
    capped.run()
    assert long.num_output_tokens == 2
    whole = Driver(max_num_batched_tokens=16)
    whole.add("long", prompt_of(3, 60), max_tokens=2)
    whole.step()
    whole.add("short", prompt_of(4, 9), max_tokens=3)
    assert [s.request.request_id for s in whole.step().scheduled] == ["long"]
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=64,
                        long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="cannot be greater than max_model_len"):
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=64,
                        long_prefill_token_threshold=65)


def test_decode_is_one_token_per_step() -> None:
    d = Driver()
    (r,) = d.add("r", [1, 2, 3, 4, 5], max_tokens=6)
    d.step()
    for k in range(2, 7):
        item = d.step().scheduled[0]
        assert item.num_new_tokens == 1 and item.samples
        assert r.num_output_tokens == k
        assert r.num_computed_tokens == r.num_tokens - 1 or r.is_finished
    assert r.is_finished and d.sched.running == []


def test_decode_into_a_new_block_allocates_it() -> None:
    d = Driver()
    (r,) = d.add("r", [1, 2, 3, 4], max_tokens=3)  # block-aligned prompt
    d.step()
    assert len(d.kv.get_block_ids(r)) == 1
    d.step()  # computes token 5: a second block
    assert len(d.kv.get_block_ids(r)) == 2
    d.run()


# --- prefix hits --------------------------------------------------------------------------


def test_waiting_request_finds_its_cached_prefix() -> None:
    d = Driver()
    shared = prompt_of(3, 12)
    d.add("a", shared + [1, 2], max_tokens=2)
    d.run()
    (b,) = d.add("b", shared + [7], max_tokens=2)
    out = d.step()
    item = d.scheduled_of(out, "b")
    assert b.num_cached_tokens == 12
    assert item.num_new_tokens == 1  # only the uncached token
    assert b.num_computed_tokens == 13
    d.run()
    assert b.num_cached_tokens == 12 and b.num_output_tokens == 2
    stats = d.kv.stats()
    assert stats.hits == 12


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    d = Driver()
    prompt = prompt_of(4, 12)  # block-aligned: the hit stops one block short
    d.add("a", prompt, max_tokens=1)
    d.run()
    (b,) = d.add("b", prompt, max_tokens=1)
    item = d.step().scheduled[0]
    assert b.num_cached_tokens == 8 and item.num_new_tokens == 4 and item.samples
    d.add("c", prompt + [5], max_tokens=1)
    item = d.step().scheduled[0]
    assert d.all["c"].num_cached_tokens == 12 and item.num_new_tokens == 1
    d.run()


def test_salted_requests_do_not_share() -> None:
    d = Driver()
    prompt = prompt_of(5, 9)
    d.add("a", prompt, salt="tenant-a", max_tokens=1)
    d.run()
    (b,) = d.add("b", prompt, salt="tenant-b", max_tokens=1)
    (c,) = d.add("c", prompt, salt="tenant-a", max_tokens=1)
    d.run()
    assert b.num_cached_tokens == 0 and c.num_cached_tokens == 8


def test_burst_sharing_a_new_prefix_computes_it_once() -> None:
    d = Driver()
    shared = prompt_of(6, 8)
    for i in range(4):
        d.add(f"r{i}", shared + [i, i], max_tokens=2)
    out = d.step()
    # Only the first computes the shared blocks; the others wait one step for a hit.
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("r0", 10)]
    out = d.step()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("r0", 1), ("r1", 2), ("r2", 2), ("r3", 2)]
    for i in range(1, 4):
        assert d.all[f"r{i}"].num_cached_tokens == 8
    d.run()
    assert d.kv.pool.num_evictions == 0
    assert sum(o.num_batched_tokens for o in d.outputs) == 10 + 3 * 2 + 4  # no duplicates
    assert d.kv.stats().hits == 24


def test_burst_of_identical_block_aligned_prompts_is_admitted_together() -> None:
    # The hit of a block-aligned prompt stops one block short (its last token is always
    # computed), so waiting for someone else's last block gains nothing: all followers
    # must be admitted on the second step, not one per step.
    d = Driver()
    prompt = prompt_of(7, 8)
    for i in range(4):
        d.add(f"r{i}", prompt, max_tokens=3)
    assert [s.request.request_id for s in d.step().scheduled] == ["r0"]
    out = d.step()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("r0", 1), ("r1", 4), ("r2", 4), ("r3", 4)]
    d.run()


def test_burst_with_chunked_prefill_waits_for_the_whole_shared_prefix() -> None:
    d = Driver(max_num_batched_tokens=4)
    shared = prompt_of(8, 12)
    d.add("a", shared + [1], max_tokens=1)
    d.add("b", shared + [2], max_tokens=1)
    d.run()
    b_chunks = [s.num_new_tokens for o in d.outputs for s in o.scheduled
                if s.request.request_id == "b"]
    assert b_chunks == [1] and d.all["b"].num_cached_tokens == 12


def test_no_caching_means_no_hits_and_no_deferral() -> None:
    d = Driver(enable_caching=False)
    prompt = prompt_of(9, 8)
    for i in range(3):
        d.add(f"r{i}", prompt + [i], max_tokens=2)
    assert len(d.step().scheduled) == 3
    d.run()
    assert all(d.all[f"r{i}"].num_cached_tokens == 0 for i in range(3))


# --- preemption -------------------------------------------------------------------------


def test_preemption_by_recompute_of_the_most_recent_request() -> None:
    d = Driver(num_blocks=6)  # 24 token slots: two requests growing past 12 tokens collide
    (a,) = d.add("a", prompt_of(10, 8), max_tokens=6)
    (b,) = d.add("b", prompt_of(11, 8), max_tokens=10)
    out = d.step()
    assert len(out.scheduled) == 2 and a.num_cached_tokens == b.num_cached_tokens == 0
    while not out.preempted:
        out = d.step()
    assert out.preempted == [b]  # the most recently admitted
    assert [s.request for s in out.scheduled] == [a]
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert d.sched.num_preemptions == 1
    assert d.sched.waiting[0] is b and b.num_computed_tokens == 0
    assert b.request_id not in d.kv.req_to_blocks
    num_full = (b.num_tokens - 1) // BS
    assert b.num_tokens - 1 == 12 and num_full == 3
    # Its blocks were freed but stay cached (a took one block: b's deepest goes first).
    cached = [h in d.kv.pool.cached for h in b.block_hashes[:num_full]]
    assert cached[:2] == [True, True]
    outputs_before = list(b.output_token_ids)
    resumed = None
    while resumed is None:
        out = d.step()
        resumed = d.scheduled_of(out, "b")
    hit = b.num_computed_tokens - resumed.num_new_tokens
    assert hit == 8, "resuming is mostly a cache hit (a evicted b's deepest block)"
    assert b.num_computed_tokens == b.num_tokens - 1 and resumed.samples
    assert b.num_cached_tokens == 0, "first admission's count is kept"
    assert b.output_token_ids[: len(outputs_before)] == outputs_before
    d.run()
    for r, n in ((a, 6), (b, 10)):
        assert r.num_output_tokens == n and r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [
            zlib.crc32(f"{r.request_id}:{8 + k}".encode()) % VOCAB for k in range(n)]


@pytest.mark.parametrize(("prompt_len", "admitted"), [(12, True), (16, False)])
def test_admission_keeps_one_free_block_per_running_request(prompt_len: int,
                                                            admitted: bool) -> None:
    d = Driver(num_blocks=6)
    (a,) = d.add("a", prompt_of(16, 7), max_tokens=4)  # holds 2 blocks, will want a third
    d.step()
    # 4 blocks free: 3 for b plus 1 kept for a fit; 4 for b would leave a none.
    (b,) = d.add("b", prompt_of(17, prompt_len), max_tokens=1)
    out = d.step()
    assert (d.scheduled_of(out, "b") is not None) == admitted
    d.run()
    assert d.sched.num_preemptions == 0
    assert [r.num_output_tokens for r in (a, b)] == [4, 1]


def test_an_idle_scheduler_admits_into_every_free_block() -> None:
    d = Driver(num_blocks=3)
    (a,) = d.add("a", prompt_of(18, 11), max_tokens=1)  # 12 tokens: all 3 blocks
    d.run()
    assert a.num_output_tokens == 1 and d.sched.num_preemptions == 0


def test_request_admitted_with_a_hit_keeps_its_first_hit_across_preemption() -> None:
    d = Driver(num_blocks=6)
    shared = prompt_of(12, 8)
    d.add("warm", shared + [1], max_tokens=1)
    d.run()
    (a,) = d.add("a", prompt_of(13, 8), max_tokens=10)
    (b,) = d.add("b", shared + [2], max_tokens=10)
    d.step()
    assert b.num_cached_tokens == 8
    while b.num_preemptions == 0:
        d.step()
    d.run()
    assert b.num_cached_tokens == 8
    assert a.num_output_tokens == b.num_output_tokens == 10


def test_no_admission_in_a_step_that_preempted() -> None:
    d = Driver(num_blocks=6)
    d.add("a", prompt_of(14, 8), max_tokens=10)
    d.add("b", prompt_of(15, 8), max_tokens=10)
    d.step()
    d.add("c", [1], max_tokens=1)
    out = d.step()
    while not out.preempted:
        assert d.all["c"].status is not RequestStatus.RUNNING or d.all["c"].is_finished
        out = d.step()
    assert d.all["c"].request_id not in {s.request.request_id for s in out.scheduled}
    d.run()


@pytest.mark.parametrize("seed", range(12))
def test_tiny_pool_random_workloads_always_finish(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([2, 4])
    num_blocks = rng.randint(3, 8)
    max_model_len = rng.randint(6, 40)
    d = Driver(num_blocks, block_size=bs, max_model_len=max_model_len,
               max_num_batched_tokens=rng.randint(1, 12), max_num_seqs=rng.randint(1, 5),
               policy=rng.choice(["fcfs", "cache_aware", "priority"]))
    limit = d.sched.max_seq_len
    base = [rng.randrange(3) for _ in range(limit)]
    expected = {}
    for i in range(rng.randint(1, 10)):
        prompt = base[: rng.randint(0, limit - 2)] + [rng.randrange(3)]
        prompt = prompt[: limit - 1]
        max_tokens = rng.randint(1, 12)
        for r in d.add(f"r{i}", prompt, n=rng.randint(1, 3), max_tokens=max_tokens,
                       salt=rng.choice([None, "s"])):
            expected[r.request_id] = min(max_tokens, limit - len(prompt))
    d.run(max_steps=3000)
    for rid, n in expected.items():
        assert d.all[rid].num_output_tokens == n, rid
        assert d.all[rid].status is RequestStatus.FINISHED_LENGTH


# --- stop conditions ----------------------------------------------------------------------


def scripted(d: Driver, script: dict[str, list[int]]) -> None:
    """The fake model returns these tokens in order for the given requests."""

    def token(req: Request) -> int:
        tokens = script.get(req.request_id)
        return tokens[req.num_output_tokens] if tokens else fake_token(req)

    d.token_fn = token


def test_max_tokens_finishes_with_length() -> None:
    d = Driver()
    (r,) = d.add("r", [1, 2, 3], max_tokens=4)
    d.run()
    assert r.num_output_tokens == 4 and r.status.finish_reason == "length"
    assert r.stop_reason is None


def test_eos_finishes_with_stop() -> None:
    d = Driver()
    (r,) = d.add("r", [1, 2, 3], max_tokens=10)
    scripted(d, {"r": [5, 6, EOS, 7]})
    d.run()
    assert r.output_token_ids == [5, 6, EOS] and r.status.finish_reason == "stop"
    assert r.stop_reason is None


def test_ignore_eos_keeps_going() -> None:
    d = Driver()
    (r,) = d.add("r", [1, 2, 3], max_tokens=4, ignore_eos=True)
    scripted(d, {"r": [EOS, EOS, 5, EOS, 6]})
    d.run()
    assert r.output_token_ids == [EOS, EOS, 5, EOS] and r.status.finish_reason == "length"


def test_stop_token_ids_finish_with_stop_and_record_the_token() -> None:
    d = Driver()
    (r,) = d.add("r", [1, 2, 3], max_tokens=10, stop_token_ids=[7], ignore_eos=True)
    scripted(d, {"r": [5, EOS, 7, 8]})
    d.run()
    assert r.output_token_ids == [5, EOS, 7] and r.status.finish_reason == "stop"
    assert r.stop_reason == 7


def test_eos_listed_in_stop_token_ids_is_no_stop_reason() -> None:
    """As vLLM checks them: EOS first."""
    d = Driver()
    (r,) = d.add("r", [1, 2, 3], max_tokens=10, stop_token_ids=[EOS, 7])
    scripted(d, {"r": [5, EOS, 8]})
    d.run()
    assert r.output_token_ids == [5, EOS] and r.status.finish_reason == "stop"
    assert r.stop_reason is None


def test_min_tokens_blocks_eos_and_stop_tokens() -> None:
    d = Driver()
    (r,) = d.add("r", [1, 2, 3], max_tokens=10, min_tokens=3, stop_token_ids=[7])
    scripted(d, {"r": [EOS, 7, 5, 7, 8]})
    d.run()
    assert r.output_token_ids == [EOS, 7, 5, 7] and r.stop_reason == 7
    (s,) = d.add("s", [1, 2, 3], max_tokens=10, min_tokens=2)
    scripted(d, {"s": [EOS, EOS, 8]})
    d.run()
    assert s.output_token_ids == [EOS, EOS] and s.status.finish_reason == "stop"


def test_stop_on_the_last_allowed_token_is_a_stop() -> None:
    d = Driver()
    (r,) = d.add("r", [1, 2, 3], max_tokens=2)
    scripted(d, {"r": [5, EOS]})
    d.run()
    assert r.status.finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [None, 100])
def test_max_model_len_caps_the_request(max_tokens: int | None) -> None:
    d = Driver(max_model_len=10)
    (r,) = d.add("r", [1, 2, 3, 4, 5, 6], max_tokens=max_tokens)
    d.run()
    assert r.num_tokens == 10 and r.num_output_tokens == 4
    assert r.status.finish_reason == "length"


def test_prompt_one_short_of_max_model_len_gets_one_token() -> None:
    d = Driver(max_model_len=7)
    (r,) = d.add("r", [1, 2, 3, 4, 5, 6], max_tokens=5)
    d.run()
    assert r.num_output_tokens == 1 and r.status.finish_reason == "length"


def test_pool_size_caps_the_request() -> None:
    d = Driver(num_blocks=3, max_model_len=1000)  # 12 token slots
    assert d.sched.max_seq_len == 12
    (r,) = d.add("r", [1, 2, 3, 4, 5], max_tokens=None)
    d.run()
    assert r.num_tokens == 12 and r.status.finish_reason == "length"


# --- parallel samples (n > 1) -----------------------------------------------------------


def test_siblings_fork_from_the_leader_with_copy_on_write_next_step() -> None:
    d = Driver(max_num_batched_tokens=8)
    leader, s1, s2 = d.add("p", prompt_of(16, 10), n=3, max_tokens=3)
    assert d.sched.num_waiting == 3
    out = d.step()
    assert out.scheduled[0].num_new_tokens == 8 and not out.scheduled[0].forks
    assert s1.status is RequestStatus.WAITING and s1.num_computed_tokens == 0
    out = d.step()
    item = out.scheduled[0]
    assert item.request is leader and item.samples and item.forks == [s1, s2]
    assert out.block_copies == []  # the copy is for the *next* forward pass
    leader_ids = d.kv.get_block_ids(leader)
    copies = []
    for child in (s1, s2):
        assert child.status is RequestStatus.RUNNING and child in d.sched.running
        assert child.num_computed_tokens == 10 and child.num_output_tokens == 1
        assert child.num_cached_tokens == leader.num_cached_tokens
        ids = d.kv.get_block_ids(child)
        assert ids[:2] == leader_ids[:2] and ids[2] != leader_ids[2]
        copies.append(BlockCopy(src=leader_ids[2], dst=ids[2]))
    for block_id in leader_ids[:2]:
        assert d.kv.pool.blocks[block_id].ref_count == 3
    assert d.kv.pool.blocks[leader_ids[2]].ref_count == 1
    out = d.step()
    assert out.block_copies == copies
    assert {s.request.request_id for s in out.scheduled} == {"p", "p#1", "p#2"}
    assert all(s.num_new_tokens == 1 for s in out.scheduled)
    assert d.step().block_copies == []
    d.run()
    for r in (leader, s1, s2):
        assert r.num_output_tokens == 3 and r.status.finish_reason == "length"
    assert len({tuple(r.output_token_ids) for r in (leader, s1, s2)}) == 3


def test_block_aligned_prompt_forks_without_a_copy() -> None:
    d = Driver()
    leader, s1 = d.add("p", prompt_of(17, 8), n=2, max_tokens=2)
    d.step()
    assert d.kv.get_block_ids(s1) == d.kv.get_block_ids(leader)
    assert d.step().block_copies == []
    d.run()
    assert s1.num_output_tokens == 2


def test_fork_without_a_free_block_sends_the_child_to_waiting() -> None:
    d = Driver(num_blocks=3)  # the leader's 10-token prompt takes all three blocks
    leader, s1, s2 = d.add("p", prompt_of(18, 10), n=3, max_tokens=2)
    d.step()
    for child in (s1, s2):
        assert child.status is RequestStatus.PREEMPTED and child in d.sched.waiting
        assert child.num_computed_tokens == 0 and child.num_output_tokens == 1
        assert child.request_id not in d.kv.req_to_blocks
    assert d.step().block_copies == []
    d.run()
    for r in (leader, s1, s2):
        assert r.num_output_tokens == 2 and r.status.finish_reason == "length"
    assert s1.num_cached_tokens == 0


def test_fork_respects_max_num_seqs() -> None:
    d = Driver(max_num_seqs=2)
    group = d.add("p", prompt_of(19, 6), n=3, max_tokens=3)
    d.step()
    assert len(d.sched.running) == 2
    assert group[2].status is RequestStatus.PREEMPTED and group[2] in d.sched.waiting
    d.run()
    assert all(r.num_output_tokens == 3 for r in group)


def test_child_finishing_at_once_with_max_tokens_one() -> None:
    d = Driver()
    group = d.add("p", prompt_of(20, 6), n=3, max_tokens=1)
    d.step()
    assert all(r.is_finished and r.num_output_tokens == 1 for r in group)
    d.run()


def test_siblings_wait_for_a_preempted_leader() -> None:
    d = Driver(num_blocks=6, max_num_batched_tokens=4)
    (a,) = d.add("a", prompt_of(21, 3), max_tokens=20)
    group = d.add("p", prompt_of(22, 13), n=2, max_tokens=2)
    d.run(max_steps=500)
    assert a.num_output_tokens == 20
    assert all(r.num_output_tokens == 2 for r in group)


# --- finish and abort ---------------------------------------------------------------------


def test_abort_running_request_mid_prefill_frees_everything() -> None:
    d = Driver(max_num_batched_tokens=4)
    (r,) = d.add("r", prompt_of(23, 14), max_tokens=5)
    d.step()
    assert d.kv.get_block_ids(r)
    d.sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert r.status.finish_reason == "abort"
    assert not d.sched.has_unfinished_requests()
    d.check_idle()
    assert d.step().is_empty
    # Its computed full block stays cached.
    assert r.block_hashes[0] in d.kv.pool.cached


def test_abort_waiting_and_unknown_requests() -> None:
    d = Driver(max_num_seqs=1)
    d.add("a", [1, 2], max_tokens=3)
    (b,) = d.add("b", [3, 4], max_tokens=3)
    d.step()
    d.sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert b not in d.sched.waiting and b.is_finished
    d.sched.finish(b, RequestStatus.FINISHED_ERROR)  # finishing twice is a no-op
    assert b.status is RequestStatus.FINISHED_ABORTED
    d.run()
    assert d.all["a"].num_output_tokens == 3


def test_abort_preempted_request() -> None:
    d = Driver(num_blocks=6)
    d.add("a", prompt_of(24, 8), max_tokens=10)
    (b,) = d.add("b", prompt_of(25, 8), max_tokens=10)
    while not b.num_preemptions:
        d.step()
    d.sched.finish(d.sched.requests["b"], RequestStatus.FINISHED_ABORTED)
    assert b not in d.sched.waiting
    d.run()


def test_a_group_with_an_id_in_use_is_refused_whole() -> None:
    """A sibling's id taken by another request refuses the group with nothing added:
    the leader added first was left in `requests`, in no queue, unfinished forever."""
    d = Driver()
    (taken,) = d.add("p#2", prompt_of(40, 10), max_tokens=2)
    with pytest.raises(ValueError, match="request id 'p#2' is already in use"):
        d.add("p", prompt_of(41, 10), n=3, max_tokens=2)
    assert list(d.sched.requests) == ["p#2"] and d.sched.num_waiting == 1
    d.run()
    assert taken.num_output_tokens == 2 and not d.sched.has_unfinished_requests()
    d.check_idle()


def test_abort_leader_with_pending_siblings_frees_everything() -> None:
    d = Driver(max_num_batched_tokens=4)
    group = d.add("p", prompt_of(26, 10), n=3, max_tokens=3)
    d.step()
    d.sched.finish(d.sched.requests["p"], RequestStatus.FINISHED_ABORTED)
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in group)
    assert not d.sched.has_unfinished_requests()
    d.check_idle()


def test_abort_one_pending_sibling_does_not_resurrect_it() -> None:
    d = Driver()
    leader, s1, s2 = d.add("p", prompt_of(27, 10), n=3, max_tokens=2)
    d.sched.finish(d.sched.requests["p#1"], RequestStatus.FINISHED_ABORTED)
    assert d.sched.num_waiting == 2
    out = d.step()
    assert out.scheduled[0].forks == [s2]
    assert s1.status is RequestStatus.FINISHED_ABORTED and s1 not in d.sched.running
    assert s1.request_id not in d.kv.req_to_blocks and s1.num_output_tokens == 0
    d.run()
    assert leader.num_output_tokens == s2.num_output_tokens == 2


def test_abort_forked_sibling_leaves_the_others_running() -> None:
    d = Driver()
    leader, s1 = d.add("p", prompt_of(28, 10), n=2, max_tokens=4)
    d.step()
    d.sched.finish(d.sched.requests["p#1"], RequestStatus.FINISHED_ABORTED)
    d.run()
    assert leader.num_output_tokens == 4 and s1.num_output_tokens == 1


# --- admission policy ---------------------------------------------------------------------


def admission_order(policy: str) -> list[str]:
    d = Driver(max_num_seqs=1, policy=policy)
    shared = prompt_of(29, 8)
    d.add("warm", shared + [1], max_tokens=1)
    d.run()
    d.add("x", prompt_of(30, 9), max_tokens=1)  # no hit
    d.add("y", shared + [2], max_tokens=1)  # hit 8
    d.add("z", shared[:4] + [3, 3, 3, 3, 3], max_tokens=1)  # hit 4
    order = []
    while d.sched.has_unfinished_requests():
        order += [s.request.request_id for s in d.step().scheduled]
    return order


def test_fcfs_keeps_arrival_order() -> None:
    assert admission_order("fcfs") == ["x", "y", "z"]


def test_cache_aware_admits_the_longest_cached_prefix_first() -> None:
    assert admission_order("cache_aware") == ["y", "z", "x"]


def test_priority_admits_lower_values_first_then_arrival_order() -> None:
    d = Driver(max_num_seqs=1, policy="priority")
    for rid, priority in (("x", 2), ("y", 0), ("z", 1), ("w", 0)):
        d.add(rid, prompt_of(40 + len(rid) + priority, 5), priority=priority, max_tokens=1)
    order = []
    while d.sched.has_unfinished_requests():
        order += [s.request.request_id for s in d.step().scheduled]
    assert order == ["y", "w", "z", "x"]


def test_priority_preempts_the_lowest_priority_running_request() -> None:
    """When blocks run out, the running request of the lowest priority (the largest
    value) is preempted, even though it was admitted first; the other runs on."""
    d = Driver(num_blocks=4, max_num_seqs=2, max_num_batched_tokens=16, policy="priority")
    (low,) = d.add("low", prompt_of(50, 4), priority=5, max_tokens=8)
    d.step()
    (high,) = d.add("high", prompt_of(51, 4), priority=0, max_tokens=8)
    preempted = []
    while d.sched.has_unfinished_requests():
        preempted += d.step().preempted
    assert preempted and set(preempted) == {low}
    assert high.num_preemptions == 0 and low.is_finished and high.is_finished
    d.check_idle()


def _first_steps(d: Driver) -> dict[str, int]:
    first: dict[str, int] = {}
    for step in range(200):
        if not d.sched.has_unfinished_requests():
            break
        for item in d.step().scheduled:
            first.setdefault(item.request.request_id, step)
    return first


def test_priority_a_deferred_request_keeps_its_seat_from_worse_priorities() -> None:
    """H waits a step for the prefix block A computes (to hit it then); L, of a worse
    priority, must not take the seat meanwhile."""
    d = Driver(max_num_seqs=2, policy="priority")
    shared = prompt_of(60, 8)
    d.add("A", shared + [1], priority=0, max_tokens=20, ignore_eos=True)
    d.add("H", shared + [2], priority=0, max_tokens=20, ignore_eos=True)
    d.add("L", prompt_of(61, 9), priority=5, max_tokens=20, ignore_eos=True)
    first = _first_steps(d)
    assert first["H"] <= first["L"], first
    d.check_idle()


def test_priority_running_requests_keep_their_share_of_the_budget() -> None:
    """A running low-priority request keeps decoding while high-priority prompts arrive
    (vLLM: running requests are budgeted in admission order; priority picks victims)."""
    d = Driver(max_num_batched_tokens=4, policy="priority")
    (low,) = d.add("L", prompt_of(70, 3), priority=5, max_tokens=100, ignore_eos=True)
    d.step()
    d.step()
    before = low.num_output_tokens
    for i in range(20):
        d.add(f"H{i}", prompt_of(80 + i, 16), priority=0, max_tokens=1, ignore_eos=True)
        d.step()
    assert low.num_output_tokens - before >= 18
    d.run()


def test_cache_aware_window_limits_the_reordering() -> None:
    d = Driver(max_num_seqs=1, policy="cache_aware")
    d.sched.config.cache_aware_window = 1
    shared = prompt_of(31, 8)
    d.add("warm", shared + [1], max_tokens=1)
    d.run()
    d.add("x", prompt_of(32, 9), max_tokens=1)
    d.add("y", shared + [2], max_tokens=1)
    assert [s.request.request_id for s in d.step().scheduled] == ["x"]
    d.run()


def test_cache_aware_does_not_starve_a_cold_request() -> None:
    """A stream of cache hits arriving behind a cold request overtakes it at most
    `cache_aware_window` times; then it runs."""
    d = Driver(max_num_seqs=1, policy="cache_aware")
    d.sched.config.cache_aware_window = 3
    shared = prompt_of(34, 8)
    d.add("warm", shared + [1], max_tokens=1)
    d.run()
    (cold,) = d.add("cold", prompt_of(35, 9), max_tokens=1)
    admitted = []
    for i in range(6):
        d.add(f"hot{i}", shared + [2, i], max_tokens=1)
        admitted += [s.request.request_id for s in d.step().scheduled]
    d.run()
    assert admitted[:4] == ["hot0", "hot1", "hot2", "cold"]
    assert cold.num_overtaken == 3


def test_cache_aware_bound_holds_within_one_step() -> None:
    """Hits admitted in one step behind a cold request: the step stops admitting once the
    cold one is due, so it is never overtaken more than the window."""
    d = Driver(max_num_seqs=8, max_num_batched_tokens=12, policy="cache_aware")
    d.sched.config.cache_aware_window = 3
    shared = prompt_of(36, 8)
    d.add("warm", shared + [1], max_tokens=1)
    d.run()
    (cold,) = d.add("cold", prompt_of(37, 9), max_tokens=1)
    for i in range(8):
        d.add(f"hot{i}", shared + [2, i, 3, 4, 5, 6], max_tokens=1)  # 6 new tokens each
    steps = [[s.request.request_id for s in d.step().scheduled] for _ in range(3)]
    assert steps[0] == ["hot0", "hot1"] and steps[1] == ["hot2"]
    assert steps[2][0] == "cold" and cold.num_overtaken == 3
    d.run()


@pytest.mark.parametrize("policy", ["fcfs", "cache_aware", "priority"])
def test_preempted_requests_go_first(policy: str) -> None:
    d = Driver(num_blocks=4, max_num_seqs=2, max_num_batched_tokens=3, policy=policy)
    shared = prompt_of(33, 8)
    (a,) = d.add("a", shared, max_tokens=8)  # grows to a fourth block
    (b,) = d.add("b", [1, 2], max_tokens=6)  # needs a second block after a takes the last
    d.step()
    d.step()
    d.step()
    assert b.num_computed_tokens > 0
    d.add("c", shared + [5], max_tokens=1)  # a long cached prefix (a's blocks)
    out = d.step()
    for _ in range(10):
        if out.preempted:
            break
        out = d.step()
    assert out.preempted == [b]
    assert list(d.sched.waiting) == [b, d.all["c"]]
    first = None
    while first is None:
        out = d.step()
        fresh = [s.request.request_id for s in out.scheduled if s.request is not a]
        first = fresh[0] if fresh else None
    assert first == "b"
    d.run()
    assert a.num_output_tokens == 8 and b.num_output_tokens == 6


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=16),
    max_tokens=st.integers(1, 12),
    num_blocks=st.integers(14, 40),
    budget=st.integers(4, 48),
    seats=st.integers(1, 8),
)
def test_caching_changes_no_decision_when_nothing_is_shared(
        lengths: list[int], max_tokens: int, num_blocks: int, budget: int, seats: int) -> None:
    """With no block in common, caching on and off must schedule, admit and preempt alike,
    step for step, until a preemption: any difference would be a cost of caching on
    traffic it cannot help (the no-sharing benchmark's target). After one they may part:
    a preempted request finds its own computed blocks again, and the budget it saves
    admits others sooner (which can even lead to a later preemption the other run avoids)."""
    traces = []
    for caching in (True, False):
        d = Driver(num_blocks, max_model_len=64, max_num_batched_tokens=budget,
                   max_num_seqs=seats, enable_caching=caching)
        for i, length in enumerate(lengths):
            # A first token no other prompt has: no two requests share even a first block.
            d.add(f"r{i}", [VOCAB + i, *prompt_of(i, length - 1)], max_tokens=max_tokens,
                  ignore_eos=True)
        d.run()
        trace = [([(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled],
                  [r.request_id for r in out.preempted]) for out in d.outputs]
        first_preemption = next((i for i, (_, preempted) in enumerate(trace) if preempted),
                                len(trace))
        traces.append(trace[: first_preemption + 1])
    assert traces[0] == traces[1]


def test_debug_log_names_where_the_cached_prefix_ends(caplog: pytest.LogCaptureFixture) -> None:
    """A hit rate lower than expected is debugged from this line: it names the block at
    which a request's prompt left the longest cached prefix."""
    d = Driver()
    d.kv = KVCacheManager(64, BS, index_children=True)  # as the engine builds it to log this
    d.sched = Scheduler(d.config, d.kv)
    prompt = prompt_of(8, 4 * BS + 1)
    d.add("a", prompt, max_tokens=1)
    d.run()
    diverged = prompt[: 2 * BS + 1] + [t + 1 for t in prompt[2 * BS + 1:]]
    with caplog.at_level("DEBUG", logger="pagellm.core.scheduler"):
        d.add("b", diverged, max_tokens=1)
        d.run()
    assert (f"b: {2 * BS} of {4 * BS + 1} prompt tokens from the prefix cache; the cached "
            f"prefix ends at block 2 of 4; the prompt departs from a cached one at token "
            f"{2 * BS + 1}") in caplog.text


def test_debug_log_departure_survives_the_admission_evicting_its_reference(
        caplog: pytest.LogCaptureFixture) -> None:
    """In a pool this small, admitting b evicts a's cached blocks, the very ones b is
    compared against: the departure is found before the allocation."""
    d = Driver(num_blocks=4)
    d.kv = KVCacheManager(4, BS, index_children=True)
    d.sched = Scheduler(d.config, d.kv)
    prompt = prompt_of(9, 3 * BS + 1)
    d.add("a", prompt, max_tokens=1)
    d.run()
    departing = prompt[:BS + 2] + [t + 1 for t in prompt[BS + 2:]]
    with caplog.at_level("DEBUG", logger="pagellm.core.scheduler"):
        d.add("b", departing, max_tokens=1)
        d.run()
    assert f"the prompt departs from a cached one at token {BS + 2}" in caplog.text
