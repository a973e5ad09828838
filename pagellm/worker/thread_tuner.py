"""How many of torch's threads a decode step runs on, chosen by timing both choices.

Why: a decode step is hundreds of short parallel regions (a few per layer), and each one
waits for every thread of the pool. When the OS gives one of those threads' cores to
another process, every region waits for it to be scheduled again. Measured on 2 cores
with one busy process beside the engine: 100 greedy tokens of the default model took
5.3 s on 2 threads against 1.1 s on 1 (0.84 s on 2 threads when the machine is quiet).
No OpenMP spin setting serves both: spinning 0 took 1.3 s contended but 1.7 s quiet,
spinning 3,000 took 0.75 s quiet but 4.0 s contended. So decode steps are timed on all
threads and on one, and run on the faster; the other is tried again now and then, since
the neighbour comes and goes. Prefill steps keep every thread: a few large regions with
dynamic work sharing lose little to a busy neighbour (1,000 prompt tokens contended: 2.8
s on 2 threads, 2.6 s on 1; quiet: 1.4 s against 2.8 s).

Pure Python and clock-free: the runner measures and reports, this only decides.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# A probe runs this many steps on the other count: the differences it looks for are large
# (5x contended, 1.25x quiet), and every probe step on the wrong count costs that much.
PROBE_STEPS = 2
MIN_INTERVAL = 32  # decode steps between probes, doubled while the choice holds
MAX_INTERVAL = 1024
SWITCH_MARGIN = 0.9  # the other count must be at least 10% faster to switch to it
DRIFT = 1.3  # the chosen count slowing down this much since the last probe probes again
_ALPHA = 0.3  # weight of a new step in the running average


@dataclass
class _Bucket:
    """The state of one batch size: step-time averages and the current choice."""

    current: int
    seconds: dict[int, float] = field(default_factory=dict)
    interval: int = MIN_INTERVAL
    # The first probe waits a whole interval too: a short run (a benchmark's 30 decode
    # steps of one batch size) pays nothing on a quiet machine, a long one finds out soon.
    countdown: int = MIN_INTERVAL
    probe_left: int = 0
    baseline: float | None = None
    switches: int = 0


class ThreadTuner:
    """Chooses 1 or `max_threads` threads per decode step, per batch size.

    `threads_for(rows)` before a decode step of `rows` sequences; `record(rows, threads,
    seconds)` after it. Batch sizes are bucketed by powers of two, each with its own
    choice: a large batch has enough work per region to keep two threads busy where a
    single sequence does not.
    """

    def __init__(self, max_threads: int) -> None:
        self.max_threads = max_threads
        self._buckets: dict[int, _Bucket] = {}
        self.switches = 0

    def threads_for(self, rows: int) -> int:
        bucket = self._bucket(rows)
        if bucket.probe_left:
            return self._other(bucket.current)
        return bucket.current

    def record(self, rows: int, threads: int, seconds: float) -> None:
        bucket = self._bucket(rows)
        if bucket.probe_left:
            bucket.probe_left -= 1
            self._average(bucket, threads, seconds)
            if bucket.probe_left == 0:
                key = _key(rows)
                self._decide(bucket, f"{key // 2 + 1}-{key}" if key > 2 else str(key))
            return
        self._average(bucket, threads, seconds)
        bucket.countdown -= 1
        drifted = (bucket.baseline is not None
                   and bucket.seconds[bucket.current] > DRIFT * bucket.baseline)
        if bucket.countdown <= 0 or drifted:
            bucket.seconds.pop(self._other(bucket.current), None)
            bucket.probe_left = PROBE_STEPS

    def _decide(self, bucket: _Bucket, rows_label: str) -> None:
        other = self._other(bucket.current)
        if bucket.seconds[other] < SWITCH_MARGIN * bucket.seconds[bucket.current]:
            # A neighbour that comes and goes switches a batch size back and forth: the
            # first switch says what is happening, the rest go to the debug log.
            logger.log(logging.DEBUG if bucket.switches else logging.INFO,
                       "decode steps of %s sequences now on %d thread(s): %.1f ms per step "
                       "against %.1f ms on %d%s", rows_label, other,
                       1000 * bucket.seconds[other], 1000 * bucket.seconds[bucket.current],
                       bucket.current,
                       "" if bucket.switches else " (later switches: debug log)")
            bucket.switches += 1
            bucket.current = other
            bucket.interval = MIN_INTERVAL
            self.switches += 1
        else:
            bucket.interval = min(2 * bucket.interval, MAX_INTERVAL)
        bucket.countdown = bucket.interval
        bucket.baseline = bucket.seconds[bucket.current]

    def _bucket(self, rows: int) -> _Bucket:
        key = _key(rows)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(current=self.max_threads)
        return bucket

    def _other(self, threads: int) -> int:
        return 1 if threads == self.max_threads else self.max_threads

    @staticmethod
    def _average(bucket: _Bucket, threads: int, seconds: float) -> None:
        previous = bucket.seconds.get(threads)
        bucket.seconds[threads] = (seconds if previous is None
                                   else (1 - _ALPHA) * previous + _ALPHA * seconds)


def _key(rows: int) -> int:
    """The bucket of a batch size: the next power of two (1, 2, 4, ...)."""
    return 1 << max(rows - 1, 0).bit_length()
