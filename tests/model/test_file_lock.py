"""The lock between processes that convert or build into one cache."""

from __future__ import annotations

import errno
import fcntl
import logging
from pathlib import Path

import pytest

from pagellm.model import file_lock


def test_a_filesystem_that_cannot_lock_goes_on_without(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Some network filesystems refuse flock: that was a "cannot write ... free space"
    error; the work goes on unlocked (it is renamed into place anyway)."""
    def refuse(*args: object) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    caplog.set_level(logging.WARNING)
    with file_lock.exclusive(tmp_path / "locks" / "x.lock", "converting x") as locked:
        assert locked is False
    assert "No locks available" in caplog.text and "converting x without the lock" in caplog.text


def test_the_lock_is_held_and_then_free(tmp_path: Path) -> None:
    path = tmp_path / "locks" / "x.lock"
    with file_lock.exclusive(path, "converting x") as locked, open(path) as other:
        assert locked
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(path) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
