"""Decides, each step, which requests compute how many tokens.

Continuous batching under a token budget: running requests go first (one decode token
each, or the next chunk of their prompt), then waiting requests are admitted while the
budget, `max_num_seqs` and the KV pool allow. A waiting request first looks its prefix up
in the cache, so it only computes what is not cached. When a running request cannot get a
block, the most recently admitted request (under the priority policy, the lowest-priority
one) is preempted by recompute: its blocks are freed
(they stay cached), so resuming it later is mostly a cache hit.

Parallel samples (n > 1) are one leader request plus siblings. The siblings wait until
the leader's prompt is computed, then fork from it: they share its full blocks and get a
copy of its partly filled last block (copy-on-write), and their first token is sampled
from the leader's logits.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

from pagellm.core.block_hash import BlockHash
from pagellm.core.config import SchedulerConfig
from pagellm.core.kv_cache_manager import BlockCopy, KVCacheManager, OutOfBlocksError
from pagellm.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    """`num_new_tokens` of `request` are computed this step, starting at its
    `num_computed_tokens`. When `samples` is set, the last of them completes the request's
    known tokens and a token is sampled from its logits for the request and each of
    `forks` (siblings that start from this request's prompt)."""

    request: Request
    num_new_tokens: int
    samples: bool
    forks: list[Request] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    # Copy these blocks' KV before the forward pass (copy-on-write of forked requests).
    block_copies: list[BlockCopy]
    preempted: list[Request]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._siblings: dict[str, list[Request]] = {}
        self._pending_copies: list[BlockCopy] = []
        self.num_preemptions = 0
        self._chunk_cap = 0  # this step's long_prefill_token_threshold (see schedule)
        # The longest sequence one request may reach: the model's limit, and never more
        # than the whole pool, so a request alone in the engine always fits.
        self.max_seq_len = min(config.max_model_len,
                               kv_cache.num_blocks * kv_cache.block_size)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(s) for s in self._siblings.values())

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request, siblings: list[Request] | None = None) -> None:
        """Queues a request; `siblings` (same prompt, n > 1) fork from it after its prefill.
        All or nothing: an id already in use (or given twice) changes nothing."""
        group = [request, *(siblings or [])]
        seen: set[str] = set()
        for member in group:
            if member.request_id in self.requests or member.request_id in seen:
                raise ValueError(f"request id {member.request_id!r} is already in use")
            seen.add(member.request_id)
        for member in group:
            self.requests[member.request_id] = member
        if siblings:
            self._siblings[request.request_id] = list(siblings)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        # vLLM's rule: a request alone starves nobody, so it takes the whole budget.
        self._chunk_cap = (self.config.long_prefill_token_threshold
                           if len(self.requests) > 1 else 0)
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        copies, self._pending_copies = self._pending_copies, []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(self._chunk(request.num_tokens - request.num_computed_tokens),
                          budget)
            if num_new <= 0:
                index += 1
                continue
            while self.kv_cache.allocate(request, num_new) is None:
                victim = self._preemption_victim()
                position = self.running.index(victim)
                del self.running[position]
                if position < index:  # already scheduled in this step: take it back
                    budget += self._unschedule(victim, scheduled)
                    index -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                index += 1

        if not preempted:
            budget = self._admit_waiting(budget, scheduled)
        return SchedulerOutput(scheduled, copies, preempted)

    def _chunk(self, num_left: int) -> int:
        """The tokens a request may compute this step, of the `num_left` it has left,
        before the step's budget (see long_prefill_token_threshold)."""
        return min(num_left, self._chunk_cap) if self._chunk_cap else num_left

    def _preemption_victim(self) -> Request:
        """The running request to preempt when blocks run out: the last admitted, or
        under the priority policy the lowest priority (largest value), latest arrival,
        as vLLM picks it."""
        if self.config.policy != "priority":
            return self.running[-1]
        return max(enumerate(self.running),
                   key=lambda item: (item[1].priority, item[1].arrival_time, item[0]))[1]

    def _unschedule(self, request: Request, scheduled: list[ScheduledRequest]) -> int:
        """Takes a request scheduled earlier in this step out again (it is being
        preempted); returns the tokens of budget it held. Siblings it would have forked
        wait for it again."""
        item = next(s for s in scheduled if s.request is request)
        scheduled.remove(item)
        if item.forks:
            self._siblings[request.request_id] = item.forks
        return item.num_new_tokens

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        """Admits waiting requests in policy order while budget, seats and blocks last.

        A request whose next uncached block is being computed in this very step by another
        request (a burst of requests sharing a new prefix) waits one step: next step that
        block is cached and it is a hit, instead of a duplicate computation.
        """
        if not self.waiting or budget <= 0 or len(self.running) >= self.config.max_num_seqs:
            return budget
        in_flight = self._blocks_in_flight(scheduled)
        deferred_priority: int | None = None
        for request in self._waiting_in_policy_order():
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if deferred_priority is not None and request.priority > deferred_priority:
                break  # nothing of a worse priority takes a seat a deferred request needs
            hits, num_cached = self.kv_cache.find_cached_prefix(request)
            next_block = len(hits)
            # Only a block the request could hit next step is worth waiting for.
            if (next_block < self.kv_cache.max_hit_blocks(request)
                    and request.block_hashes[next_block] in in_flight
                    and not self._overdue(request)):
                if self.config.policy == "priority" and deferred_priority is None:
                    deferred_priority = request.priority
                continue
            num_new = min(self._chunk(request.num_tokens - num_cached), budget)
            # Before allocating, which may evict the very blocks it compares against.
            departure = (self.kv_cache.departure(request, len(hits))
                         if request.num_cached_tokens < 0 and logger.isEnabledFor(logging.DEBUG)
                         else None)
            # One free block kept per running request for its next block: admitting into
            # the last free blocks only to preempt (and recompute) someone a few steps
            # later is slower than waiting for a request to finish.
            if self.kv_cache.allocate(request, num_new, hits, reserve=len(self.running)) is None:
                break
            now_due = self._take_from_waiting(request)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug(
                        "%s: %d of %d prompt tokens from the prefix cache; the cached prefix "
                        "ends at block %d of %d%s", request.request_id, num_cached,
                        request.num_tokens, len(hits), len(request.block_hashes),
                        "" if departure is None else
                        f"; the prompt departs from a cached one at token {departure}")
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            in_flight.update(self._new_full_blocks(request, num_new))
            budget -= num_new
            if now_due:
                break  # the order was built before it was due: it goes first next step
        return budget

    def _blocks_in_flight(self, scheduled: list[ScheduledRequest]) -> set[BlockHash]:
        if not self.kv_cache.enable_caching:
            return set()
        in_flight: set[BlockHash] = set()
        for item in scheduled:
            in_flight.update(self._new_full_blocks(item.request, item.num_new_tokens))
        return in_flight

    def _new_full_blocks(self, request: Request, num_new: int) -> list[BlockHash]:
        """Hashes of the blocks this step fills for the request (none without caching:
        nobody could hit them)."""
        if not self.kv_cache.enable_caching:
            return []
        size = self.kv_cache.block_size
        first = request.num_computed_tokens // size
        last = (request.num_computed_tokens + num_new) // size
        return request.block_hashes[first:last]

    def _take_from_waiting(self, request: Request) -> bool:
        """Removes an admitted request from the queue; everyone still ahead of it was
        overtaken once more. True when that made one of them due (see `_overdue`)."""
        position = self.waiting.index(request)
        now_due = False
        for ahead in itertools.islice(self.waiting, position):
            ahead.num_overtaken += 1
            now_due = now_due or self._overdue(ahead)
        del self.waiting[position]
        return now_due

    def _overdue(self, request: Request) -> bool:
        """Overtaken as often as the cache-aware policy allows: it goes next, and does not
        even wait a step for a block another request is computing."""
        return (self.config.policy == "cache_aware"
                and request.num_overtaken >= self.config.cache_aware_window)

    def _waiting_in_policy_order(self) -> list[Request]:
        """FCFS: queue order. Priority: by priority, then queue order (see
        SchedulerConfig). Cache-aware: within the first `cache_aware_window` requests, the
        longest cached prefix first (ties keep queue order), so requests on a prefix in the
        pool run together before it is evicted, and share its blocks while they do.

        Preempted requests always go first (under the priority policy, first within their
        priority): they hold outputs a client is waiting on. So does, in queue order, a
        request already overtaken `cache_aware_window` times: a stream of cache hits must
        not starve a request whose prefix is cold.
        """
        waiting = list(self.waiting)
        if self.config.policy == "fcfs" or not waiting:
            return waiting
        if self.config.policy == "priority":
            # Within a priority, preempted requests first, then queue order.
            return sorted(waiting, key=lambda r: (r.priority,
                                                  r.status is not RequestStatus.PREEMPTED))
        limit = self.config.cache_aware_window
        window = waiting[:limit]
        # A stable sort: the urgent ones, then the rest, each in queue order but for hits.
        window.sort(key=lambda r: (0, 0) if r.status is RequestStatus.PREEMPTED
                    or self._overdue(r) else (1, -self.kv_cache.find_cached_prefix(r)[1]))
        return window + waiting[limit:]

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        samples = request.num_computed_tokens + num_new == request.num_tokens
        forks = self._siblings.pop(request.request_id, []) if samples else []
        return ScheduledRequest(request, num_new, samples, forks)

    def preempt_running(self) -> None:
        """Preempts every running request between two steps, freeing all their blocks;
        each recomputes once admitted again (vLLM's `reset_prefix_cache(
        reset_running_requests=True)`, which needs no block held)."""
        for request in reversed(self.running):
            self._preempt(request)
        self.running.clear()
        # Copy-on-write copies queued by forks only write into blocks of running
        # requests, which were all just freed.
        self._pending_copies.clear()

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, int]
    ) -> list[Request]:
        """Advances computed tokens, publishes full blocks, appends sampled tokens.

        `sampled` maps request id -> token for every request that sampled (including forks).
        Returns the requests that received a token this step, finished ones included (their
        blocks are already freed).
        """
        updated: list[Request] = []
        for item in output.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            self.kv_cache.cache_full_blocks(request)
            if not item.samples:
                continue
            for child in item.forks:
                self._fork(request, child)
            for target in [request, *item.forks]:
                if target.is_finished:
                    continue
                target.append_output_token(sampled[target.request_id])
                self._check_stop(target)
                updated.append(target)
        return updated

    def _fork(self, parent: Request, child: Request) -> None:
        """Starts a sibling from the parent's computed prompt; if no seat is left
        (`max_num_seqs`) or no block is free for its copy-on-write block, it waits instead
        and recomputes (mostly from the cache)."""
        child.num_cached_tokens = parent.num_cached_tokens
        copies: list[BlockCopy] | None = None
        if len(self.running) < self.config.max_num_seqs:
            try:
                copies = self.kv_cache.fork(parent, child)
            except OutOfBlocksError:
                pass
        if copies is None:
            child.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(child)
            return
        self._pending_copies.extend(copies)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    def _check_stop(self, request: Request) -> None:
        params = request.sampling_params
        token = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            # EOS first, as in vLLM: an EOS also listed in stop_token_ids is no stop reason.
            if not params.ignore_eos and token in request.eos_token_ids:
                self.finish(request, RequestStatus.FINISHED_STOPPED)
                return
            if token in params.stop_token_ids:
                request.stop_reason = token
                self.finish(request, RequestStatus.FINISHED_STOPPED)
                return
        max_tokens = params.max_tokens
        if (max_tokens is not None and request.num_output_tokens >= max_tokens) or (
            request.num_tokens >= self.max_seq_len
        ):
            self.finish(request, RequestStatus.FINISHED_LENGTH)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Ends a request (stop, length, abort, error): frees its blocks, which stay cached.

        Siblings still waiting to fork from it end with it.
        """
        if request.is_finished:
            return
        request.status = status
        self.kv_cache.free(request)
        self.requests.pop(request.request_id, None)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            # A sibling still waiting to fork: it must not fork (and run) later.
            for siblings in self._siblings.values():
                if request in siblings:
                    siblings.remove(request)
                    break
        for sibling in self._siblings.pop(request.request_id, []):
            self.finish(sibling, status)
