"""Peak resident memory of a run, sampled over the contender's processes.

`resource.getrusage` gives a peak for the whole life of this process, which mixes up the
contenders of one invocation; a sampler that starts with the run and follows the
contender's process tree gives each run its own peak. A contender in this process is
measured with it (and its children); one in processes of its own (a vLLM driver, a
server) by those alone, so the harness's own memory is not billed to it.
"""

from __future__ import annotations

import threading
from types import TracebackType

import psutil


def _tree_rss(process: psutil.Process) -> int:
    """0 once the process is gone: a contender that died reports its own error, not
    this sampler's."""
    try:
        members = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for member in members:
        try:
            total += member.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


class PeakRSS:
    """`with PeakRSS() as peak: ...` then `peak.mb`: the highest RSS of process `pid`
    (None: this one) and its children, summed, seen every `interval_s` while the block
    ran."""

    def __init__(self, pid: int | None = None, interval_s: float = 0.05) -> None:
        self._interval = interval_s
        self._process = psutil.Process(pid)
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self._peak = max(self._peak, _tree_rss(self._process))
            if self._stop.wait(self._interval):
                return

    def __enter__(self) -> PeakRSS:
        self._peak = _tree_rss(self._process)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, _tree_rss(self._process))

    @property
    def mb(self) -> float:
        return self._peak / 2**20
