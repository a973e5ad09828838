"""The run's peak memory is the contender's: a contender in processes of its own is
measured by those (and their children) alone, not with the harness's memory."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from pagellm.bench.memory import PeakRSS

_HOLD = 200 << 20


def test_a_contender_in_its_own_process_is_measured_alone() -> None:
    ballast = bytearray(_HOLD)  # the harness's own memory, which must not count
    code = (f"import time; data = bytearray({_HOLD}); data[::4096] = b'x' * len(data[::4096]);"
            "print('ready', flush=True); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        with PeakRSS(child.pid) as its_own, PeakRSS() as with_harness:
            time.sleep(0.2)
        child_rss = psutil.Process(child.pid).memory_info().rss / 2**20
    finally:
        child.kill()
        child.wait()
    assert _HOLD / 2**20 <= its_own.mb <= child_rss + 1
    assert with_harness.mb >= its_own.mb + len(ballast) / 2**20


def test_a_process_that_ended_reads_as_nothing() -> None:
    """A contender whose process died reports its own error; the sampler watching that
    process must not replace it with psutil's NoSuchProcess."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    with PeakRSS(child.pid) as peak:
        child.wait()
        time.sleep(0.1)
    assert peak.mb >= 0
