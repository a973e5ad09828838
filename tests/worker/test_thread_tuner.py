"""The decode thread-count choice, driven by simulated step times."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from pagellm.worker.thread_tuner import MAX_INTERVAL, MIN_INTERVAL, PROBE_STEPS, ThreadTuner

QUIET = {2: 0.008, 1: 0.010}  # all threads a little faster
CONTENDED = {2: 0.050, 1: 0.011}  # a busy neighbour: each region waits for a core


def run(tuner: ThreadTuner, steps: int, cost: Callable[[int], float] | dict[int, float],
        rows: int = 1) -> list[int]:
    """The thread counts used for `steps` decode steps whose time is cost[threads]."""
    used = []
    for _ in range(steps):
        threads = tuner.threads_for(rows)
        used.append(threads)
        tuner.record(rows, threads, cost(threads) if callable(cost) else cost[threads])
    return used


def test_quiet_machine_keeps_all_threads_and_probes_ever_less() -> None:
    tuner = ThreadTuner(2)
    used = run(tuner, 4000, QUIET)
    first_probe = slice(MIN_INTERVAL, MIN_INTERVAL + PROBE_STEPS)
    assert used[:MIN_INTERVAL] == [2] * MIN_INTERVAL and used[first_probe] == [1] * PROBE_STEPS
    assert tuner.switches == 0
    assert used[-1000:].count(1) <= PROBE_STEPS  # probes back off to every MAX_INTERVAL
    assert used.count(1) / len(used) < 0.01
    assert tuner._buckets[1].interval == MAX_INTERVAL


def test_busy_neighbour_moves_decode_to_one_thread_and_back() -> None:
    tuner = ThreadTuner(2)
    contended = run(tuner, 300, CONTENDED)
    assert tuner.switches == 1 and contended[-50:].count(1) >= 50 - PROBE_STEPS
    # One interval on the slow count before the first probe, then (almost) all fast.
    assert sum(CONTENDED[t] for t in contended) < (MIN_INTERVAL * CONTENDED[2]
                                                   + 1.3 * 300 * CONTENDED[1])
    quiet_again = run(tuner, 300, QUIET)
    assert tuner.switches == 2 and quiet_again[-50:].count(2) >= 50 - PROBE_STEPS


def test_a_neighbour_arriving_is_noticed_without_waiting_for_the_next_probe() -> None:
    tuner = ThreadTuner(2)
    run(tuner, 1500, QUIET)  # probes are now hundreds of steps apart
    assert tuner._buckets[1].interval >= 256
    used = run(tuner, 10, CONTENDED)
    assert tuner.switches == 1 and used[-3:] == [1, 1, 1]


def test_batch_sizes_choose_apart() -> None:
    """A big batch keeps two threads busy where one sequence leaves them waiting."""
    tuner = ThreadTuner(2)
    run(tuner, 200, CONTENDED, rows=1)
    run(tuner, 200, {2: 0.020, 1: 0.035}, rows=48)
    assert tuner.threads_for(1) == 1 and tuner.threads_for(48) == 2
    assert tuner.threads_for(33) == 2  # same power-of-two bucket as 48


def test_noise_within_the_margin_does_not_switch() -> None:
    tuner = ThreadTuner(2)
    noisy = iter([0.008, 0.0085] * 5000)
    run(tuner, 2000, lambda threads: next(noisy) if threads == 2 else 0.0079)
    assert tuner.switches == 0


def test_only_a_batch_sizes_first_switch_is_logged_at_info(caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    """A neighbour that comes and goes flips the choice often; the log says so once."""
    tuner = ThreadTuner(2)
    with caplog.at_level(logging.DEBUG, logger="pagellm.worker.thread_tuner"):
        for _ in range(3):
            run(tuner, 300, CONTENDED)
            run(tuner, 300, QUIET)
    assert tuner.switches == 6
    levels = [record.levelno for record in caplog.records]
    assert levels == [logging.INFO] + [logging.DEBUG] * 5
    assert "later switches: debug log" in caplog.records[0].getMessage()
