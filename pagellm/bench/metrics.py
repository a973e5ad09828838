"""Per-request records and the figures a run reports, computed the same way for every
contender so that their ratios mean something."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One finished request, times in seconds since the run started (each contender's
    own clock, converted once in its runner).

    `token_times` has one entry per generated token where the contender reports it per
    token; a streaming client that receives several tokens in one chunk repeats the
    chunk's time. `output_ids` is empty where only a count is known (a streaming text
    client); `cached_tokens` is None where the contender cannot tell.
    """

    prompt_len: int
    output_len: int
    output_ids: list[int]
    arrival: float
    first_token: float
    finish: float
    token_times: list[float] = field(default_factory=list)
    cached_tokens: int | None = None

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, NaN for no values (a
    missing figure must show as missing, never as zero)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def hit_rate_timeline(records: list[RequestRecord]) -> list[tuple[float, float]]:
    """(finish time, cumulative hit rate) after each finished request, in finishing order:
    cached prompt tokens over prompt tokens of every request finished so far."""
    timeline = []
    cached = total = 0
    for record in sorted(records, key=lambda r: r.finish):
        if record.cached_tokens is None:
            return []
        cached += record.cached_tokens
        total += record.prompt_len
        timeline.append((record.finish, cached / total if total else 0.0))
    return timeline


def peak_decoding(records: list[RequestRecord]) -> int:
    """The most requests that were between their first and last token at once: a lower
    bound on how many ran together, measured, where the engine's cap (max_num_seqs) only
    says how many could (a small KV pool keeps far fewer running)."""
    edges = sorted([(r.first_token, 1) for r in records if not math.isnan(r.first_token)]
                   + [(r.finish, -1) for r in records if not math.isnan(r.first_token)])
    running = peak = 0
    for _, change in edges:
        running += change
        peak = max(peak, running)
    return peak


def bookkeeping_share(timings: dict[str, float]) -> float:
    """(schedule + prepare inputs + update) / step time: what the engine spends around
    the model's forward and sampling."""
    parts = ("schedule_s", "prepare_s", "forward_s", "sample_s", "update_s")
    step = sum(timings.get(p, 0.0) for p in parts)
    overhead = sum(timings.get(p, 0.0) for p in ("schedule_s", "prepare_s", "update_s"))
    return overhead / step if step else math.nan


@dataclass
class RunResult:
    """One contender on one workload in one mode: the figures the report shows."""

    contender: str
    workload: str
    mode: str
    wall_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    ttft: dict[str, float]
    itl: dict[str, float]
    cached_prompt_tokens: int | None
    computed_prompt_tokens: int | None
    hit_rate: float | None
    peak_rss_mb: float | None
    startup_s: float | None = None
    # Whether computed_prompt_tokens was counted by the engine (prompts recomputed after
    # a preemption included) rather than taken as prompt minus cached.
    computed_measured: bool = False
    peak_decoding: int | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    step_breakdown: dict[str, float] = field(default_factory=dict)
    bookkeeping_share: float | None = None
    hit_rate_timeline: list[tuple[float, float]] = field(default_factory=list)
    ttft_samples: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def engine_notes(engine: dict[str, Any]) -> list[str]:
    """The KV pool each engine really got, and the cores vLLM's worker computed on: a
    comparison is only fair when pools hold the same number of tokens, and its reader
    must know when the engines computed on different numbers of cores."""
    tokens, dtype = engine.get("kv_pool_tokens"), engine.get("kv_pool_dtype")
    notes = [f"KV pool {tokens:,} tokens" + (f" of {dtype}" if dtype else "")] if tokens else []
    if engine.get("vllm_worker_cores"):
        notes.append(f"vLLM's worker threads bound to cores {engine['vllm_worker_cores']}")
    return notes


def load_note() -> str:
    """The machine's 1-minute load average next to its core count: on a shared machine
    this says how far a run's numbers can be trusted."""
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end"


def summarize(contender: str, workload: str, mode: str, records: list[RequestRecord],
              wall_s: float, peak_rss_mb: float | None = None,
              startup_s: float | None = None, timings: dict[str, float] | None = None,
              engine: dict[str, Any] | None = None) -> RunResult:
    """The figures of one run from its request records and, where the contender has
    them, its engine-side step timings."""
    ttfts = [r.ttft for r in records if not math.isnan(r.ttft)]
    itls = [gap for r in records for gap in r.inter_token_latencies]
    prompt_tokens = sum(r.prompt_len for r in records)
    output_tokens = sum(r.output_len for r in records)
    known = all(r.cached_tokens is not None for r in records) and bool(records)
    cached = sum(r.cached_tokens or 0 for r in records) if known else None
    measured = (engine or {}).get("prompt_tokens_computed")
    computed = (int(measured) if measured is not None
                else prompt_tokens - cached if cached is not None else None)
    breakdown: dict[str, float] = {}
    share = None
    if timings:
        steps = max(timings.get("steps", 0.0), 1.0)
        breakdown = {name: timings.get(f"{name}_s", 0.0) / steps * 1000.0
                     for name in ("schedule", "prepare", "forward", "sample", "update")}
        breakdown["steps"] = timings.get("steps", 0.0)
        share = bookkeeping_share(timings)
    return RunResult(
        contender=contender, workload=workload, mode=mode, wall_s=wall_s,
        num_requests=len(records), prompt_tokens=prompt_tokens, output_tokens=output_tokens,
        requests_per_s=len(records) / wall_s if wall_s else math.nan,
        output_tokens_per_s=output_tokens / wall_s if wall_s else math.nan,
        total_tokens_per_s=(prompt_tokens + output_tokens) / wall_s if wall_s else math.nan,
        ttft={"mean": mean(ttfts), "p50": percentile(ttfts, 50), "p90": percentile(ttfts, 90),
              "p99": percentile(ttfts, 99)},
        itl={"mean": mean(itls), "p50": percentile(itls, 50), "p90": percentile(itls, 90),
             "p99": percentile(itls, 99)},
        cached_prompt_tokens=cached,
        computed_prompt_tokens=computed, computed_measured=measured is not None,
        peak_decoding=peak_decoding(records),
        hit_rate=cached / prompt_tokens if cached is not None and prompt_tokens else None,
        peak_rss_mb=peak_rss_mb, startup_s=startup_s, engine=dict(engine or {}),
        step_breakdown=breakdown, bookkeeping_share=share,
        hit_rate_timeline=hit_rate_timeline(records), ttft_samples=ttfts,
        notes=[load_note(), *engine_notes(engine or {})],
    )
