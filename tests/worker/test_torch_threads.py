"""torch's process-wide thread count as engines change it (pagellm/worker/torch_threads.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagellm.worker.torch_threads import set_threads, users_threads


@pytest.fixture(autouse=True)
def _torch_threads_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """torch's count and the module's record of it, as they were: an engine built later
    in this process must not start from these tests' counts."""
    from pagellm.worker import torch_threads

    monkeypatch.setattr(torch_threads, "_users_count", None)
    monkeypatch.setattr(torch_threads, "_our_count", None)
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_a_count_an_engine_left_is_not_taken_for_the_users(
        _torch_threads_restored: int) -> None:
    """After `LLM(num_threads=1)` (or a tuned run whose last decode step ran on one
    thread), a notebook's next `LLM()` ran on one thread with its tuner off."""
    users = _torch_threads_restored
    set_threads(1)
    assert torch.get_num_threads() == 1 and users_threads() == users
    set_threads(users)
    set_threads(1)  # the tuner's one-thread step
    assert users_threads() == users


def test_a_count_the_user_sets_is_theirs() -> None:
    set_threads(1)
    torch.set_num_threads(3)
    assert users_threads() == 3
    set_threads(2)
    assert torch.get_num_threads() == 2 and users_threads() == 3
