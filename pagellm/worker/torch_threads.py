"""torch's thread count, which is the whole process's: every engine in it and the user's
own torch code share it.

PageLLM sets it (an engine's `num_threads`, the thread tuner's one-thread decode steps),
and without this record a later engine built without `num_threads` took whatever was
left as the machine's count: after `LLM(num_threads=1)`, or a tuned run whose last step
ran on one thread, a notebook's next `LLM()` ran on one thread with its tuner off. The
count the user leaves (torch's own, or one they set themselves) is what such an engine
starts from. Counts are all there is to go by: a count the user sets equal to the one
PageLLM set last reads as PageLLM's (pass `num_threads` to be sure).
"""

from __future__ import annotations

import torch

_users_count: int | None = None  # torch's count before PageLLM last changed it
_our_count: int | None = None  # the count PageLLM set last


def set_threads(count: int) -> None:
    """Sets torch's thread count, remembering the one it replaces when that is not ours."""
    global _users_count, _our_count
    current = torch.get_num_threads()
    if current != _our_count:  # torch's own count, or one the user set since we did
        _users_count = current
    if count != current:
        torch.set_num_threads(count)
    _our_count = count


def users_threads() -> int:
    """The thread count as the user left it: torch's now, unless PageLLM set it."""
    current = torch.get_num_threads()
    if current == _our_count and _users_count is not None:
        return _users_count
    return current
