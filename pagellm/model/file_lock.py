"""An exclusive lock between processes (flock), for work done once into a shared cache:
converting a GGUF, building the CPU kernels. Processes starting together then do the
work once, the others waiting for it; and whoever holds the lock knows that anything
half-written it finds was left by a process that died (a pid would not tell: containers
sharing a cache have pid namespaces of their own). The lock goes with the process, so a
killed holder never leaves it held."""

from __future__ import annotations

import contextlib
import fcntl
import logging
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def exclusive(path: Path, doing: str) -> Iterator[bool]:
    """Holds the lock at `path` (a file, created if need be), waiting while another
    process holds it; `doing` says what for in the log line about the wait. Yields
    whether it holds the lock: on a filesystem that cannot lock (some network ones) it
    goes on without, since the work is renamed into place anyway and at worst done
    twice."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("another process is %s; waiting for it", doing)
                fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as error:
            logger.warning("cannot lock %s (%s); %s without the lock", path, error, doing)
            yield False
            return
        yield True
