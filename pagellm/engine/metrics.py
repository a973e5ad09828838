"""The engine's metrics as records: what `LLM.get_metrics()` returns and what the server's
`/metrics` page prints, from one snapshot so the two never disagree.

The record types are vLLM's (`vllm.v1.metrics.reader`: Counter, Gauge, Histogram, each
with a name and labels), so code that walks `llm.get_metrics()` in vLLM walks PageLLM's.
Counters and gauges come from the engine's stats when the snapshot is taken; the latency
histograms and finish-reason counts are recorded by the engine itself, each token as it
is generated and each request as it ends (finished, aborted or failed), so they count
every request whoever asked for it and however it was read.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagellm.engine.outputs import RequestMetrics

if TYPE_CHECKING:
    from pagellm.engine.llm_engine import EngineStats

FINISHED_ABORT = "abort"
FINISH_REASONS = ("stop", "length", FINISHED_ABORT, "error")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0, 20.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0)

# Each metric's one-line meaning (Prometheus' HELP), which also fixes the order they
# are listed in. A counter is named without the `_total` its samples carry on the
# /metrics page, as prometheus_client names it (and vLLM's get_metrics() records).
HELP = {
    "pagellm_prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "pagellm_prefix_cache_hits": "Prompt tokens served from the prefix cache.",
    "pagellm_prefix_cache_evictions": "Cached KV blocks evicted to make room.",
    "pagellm_kv_cache_usage": "Fraction of KV cache blocks in use (0 when idle).",
    "pagellm_kv_cache_blocks": "KV cache blocks in the pool.",
    "pagellm_num_requests_running": "Requests scheduled in the running batch.",
    "pagellm_num_requests_waiting": "Requests waiting to be scheduled.",
    "pagellm_num_preemptions": "Requests preempted (their KV freed) to make room.",
    "pagellm_prompt_tokens": "Prompt tokens of requests whose prompt was computed "
                                   "(cached ones included).",
    "pagellm_generation_tokens": "Tokens generated.",
    "pagellm_request_finished": "Completions ended, by finish reason (abort: "
                                      "unfinished, e.g. the client left).",
    "pagellm_time_to_first_token_seconds": "Time from a request's arrival to its first "
                                           "generated token.",
    "pagellm_inter_token_latency_seconds": "Time between consecutive generated tokens of a "
                                           "request.",
    "pagellm_e2e_request_latency_seconds": "Time from a request's arrival to its last token "
                                           "(finished requests only).",
}

# The series vLLM has too, again under its names (same meaning, same model_name label),
# so dashboards, alerts and autoscalers written against vLLM's read them.
VLLM_NAMES = {
    "pagellm_prefix_cache_queries": "vllm:prefix_cache_queries",
    "pagellm_prefix_cache_hits": "vllm:prefix_cache_hits",
    "pagellm_kv_cache_usage": "vllm:kv_cache_usage_perc",
    "pagellm_num_requests_running": "vllm:num_requests_running",
    "pagellm_num_requests_waiting": "vllm:num_requests_waiting",
    "pagellm_num_preemptions": "vllm:num_preemptions",
    "pagellm_prompt_tokens": "vllm:prompt_tokens",
    "pagellm_generation_tokens": "vllm:generation_tokens",
    "pagellm_request_finished": "vllm:request_success",
    "pagellm_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "pagellm_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "pagellm_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
}


@dataclass
class Metric:
    """One series: its name and labels (a counter's name is without `_total`)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A count that only grows."""

    value: int


@dataclass
class Gauge(Metric):
    """A value that goes up and down (queue lengths, pool usage)."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: `buckets` maps each upper bound, as Prometheus writes it
    ("0.1", ..., "+Inf"), to the observations at or below it (cumulative, as vLLM's)."""

    count: int
    sum: float
    buckets: dict[str, int]


def bound_text(bound: float) -> str:
    """A bucket bound as Prometheus writes it."""
    return "+Inf" if math.isinf(bound) else repr(float(bound))


class LatencyHistogram:
    """Records observations into fixed buckets."""

    def __init__(self, name: str, bounds: Sequence[float]) -> None:
        self.name = name
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self, labels: dict[str, str]) -> Histogram:
        """The record of it now, with cumulative buckets as Prometheus reads them."""
        buckets: dict[str, int] = {}
        cumulative = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            cumulative += count
            buckets[bound_text(bound)] = cumulative
        return Histogram(self.name, dict(labels), cumulative, self.sum, buckets)


class RequestLatencies:
    """Latency histograms and finish-reason counts, per completion (as vLLM counts an
    n > 1 request's samples). The engine records each token as it is generated and each
    request as it ends, on its own thread, and hands out copies with its stats."""

    def __init__(self) -> None:
        self.time_to_first_token = LatencyHistogram("pagellm_time_to_first_token_seconds",
                                                    TTFT_BUCKETS)
        self.inter_token_latency = LatencyHistogram("pagellm_inter_token_latency_seconds",
                                                    ITL_BUCKETS)
        self.e2e_request_latency = LatencyHistogram("pagellm_e2e_request_latency_seconds",
                                                    E2E_BUCKETS)
        # Completions by how they ended: "stop", "length", "abort" or "error".
        self.requests_finished: dict[str, int] = {}

    def first_token(self, seconds: float) -> None:
        """A completion's first token, `seconds` after its request arrived: recorded as
        it is generated, as vLLM does, so a long answer is not missing until it ends."""
        self.time_to_first_token.observe(seconds)

    def token_gap(self, seconds: float) -> None:
        """A completion's next token, `seconds` after its previous one."""
        self.inter_token_latency.observe(seconds)

    def ended(self, metrics: RequestMetrics, reasons: Sequence[str | None],
              completed: bool) -> None:
        """A request that ended, with each completion's finish reason (None reads
        "abort"). Only a `completed` request (finished or failed, not aborted) has an
        end-to-end time."""
        end = metrics.finished_time or metrics.last_token_time
        for reason in reasons:
            if completed and end is not None:
                self.e2e_request_latency.observe(end - metrics.arrival_time)
            reason = reason or FINISHED_ABORT
            self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1

    def copy(self) -> RequestLatencies:
        """A snapshot for other threads to read while the engine goes on."""
        copy = RequestLatencies()
        for mine, theirs in ((self.time_to_first_token, copy.time_to_first_token),
                             (self.inter_token_latency, copy.inter_token_latency),
                             (self.e2e_request_latency, copy.e2e_request_latency)):
            theirs.counts, theirs.sum = list(mine.counts), mine.sum
        copy.requests_finished = dict(self.requests_finished)
        return copy


def metrics_snapshot(stats: EngineStats, model_name: str) -> list[Metric]:
    """Every metric in `stats`, labelled with the model's name, in `HELP`'s order; then
    those vLLM has, again under vLLM's names."""
    labels = {"model_name": model_name}
    latencies = stats.latencies
    metrics: list[Metric] = [
        Counter("pagellm_prefix_cache_queries", labels, stats.prefix_cache_queries),
        Counter("pagellm_prefix_cache_hits", labels, stats.prefix_cache_hits),
        Counter("pagellm_prefix_cache_evictions", labels, stats.num_evictions),
        Gauge("pagellm_kv_cache_usage", labels, stats.kv_cache_usage),
        Gauge("pagellm_kv_cache_blocks", labels, stats.num_blocks),
        Gauge("pagellm_num_requests_running", labels, stats.num_running),
        Gauge("pagellm_num_requests_waiting", labels, stats.num_waiting),
        Counter("pagellm_num_preemptions", labels, stats.num_preemptions),
        Counter("pagellm_prompt_tokens", labels, stats.prompt_tokens),
        Counter("pagellm_generation_tokens", labels, stats.generation_tokens),
        *(Counter("pagellm_request_finished", {**labels, "finished_reason": reason},
                  latencies.requests_finished.get(reason, 0))
          for reason in sorted({*FINISH_REASONS, *latencies.requests_finished})),
        *(histogram.snapshot(labels) for histogram in (
            latencies.time_to_first_token, latencies.inter_token_latency,
            latencies.e2e_request_latency)),
    ]
    return ([_copy(metric, metric.name) for metric in metrics]
            + [_copy(metric, VLLM_NAMES[metric.name]) for metric in metrics
               if metric.name in VLLM_NAMES])


def _copy(metric: Metric, name: str) -> Metric:
    """A record of its own (labels, buckets), so a caller changing one changes no other."""
    copy = dataclasses.replace(metric, name=name, labels=dict(metric.labels))
    if isinstance(copy, Histogram):
        copy.buckets = dict(copy.buckets)
    return copy
