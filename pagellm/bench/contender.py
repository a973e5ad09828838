"""What the harness needs from an engine under test, whatever engine it is.

A contender is started once per workload (so every run starts with an empty cache and
the KV pool that workload asks for), generates greedily for lists of token-id prompts,
and says what it knows about its own cache and step timings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pagellm.bench.metrics import RequestRecord


@dataclass(frozen=True)
class GenerateRequest:
    """One call's worth of prompts, greedy, `max_tokens` each. With `ignore_eos` every
    request generates exactly `max_tokens` (equal work for every contender); without it a
    request ends at EOS, as a chat answer does."""

    prompts: Sequence[Sequence[int]]
    max_tokens: int
    ignore_eos: bool = True


class Contender(Protocol):
    """An engine under test. Times in `RequestRecord`s are seconds since `origin`, a
    `time.perf_counter()` value the harness takes at the start of the run."""

    name: str

    def start(self, kv_cache_tokens: int | None, warmup: list[int]) -> float:
        """Loads the engine and runs `warmup` once; returns the start-up seconds (load
        and warm-up, as vLLM's start-up includes its own: reported apart from the run)."""
        ...

    def process_id(self) -> int | None:
        """The process the engine runs in, where that is not this one (None): its
        memory is the run's, the harness's own left out."""
        ...

    def generate(self, request: GenerateRequest, origin: float) -> list[RequestRecord]:
        """Records in prompt order."""
        ...

    def stats(self) -> dict[str, Any]:
        """Engine-side counters since the end of warm-up (may be empty)."""
        ...

    def timings(self) -> dict[str, float] | None:
        """Per-phase step seconds since warm-up (`schedule_s`, `prepare_s`, `forward_s`,
        `sample_s`, `update_s`, `steps`), or None where the engine has no such split."""
        ...

    def close(self) -> None: ...
