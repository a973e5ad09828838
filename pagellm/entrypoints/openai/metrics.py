"""Prometheus metrics at /metrics, in the text exposition format (written by hand).

Counters and gauges are read from the engine's latest stats snapshot when scraped, so the
engine keeps one source of truth and the server adds nothing to its hot loop. Latency
histograms and finish-reason counts are fed by the serving code when a request ends, from
the engine's own timestamps. Everything here runs on the event loop thread, so nothing needs a lock.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import reprlib
from collections.abc import Iterable, Sequence

from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISHED_ABORT = "abort"
FINISH_REASONS = ("stop", "length", FINISHED_ABORT)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0, 20.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0)

# The series vLLM has too, again under its names (same meaning, same model_name label),
# so dashboards, alerts and autoscalers written against vLLM's /metrics read them.
VLLM_NAMES = {
    "pagellm_prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
    "pagellm_prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
    "pagellm_kv_cache_usage": "vllm:kv_cache_usage_perc",
    "pagellm_num_requests_running": "vllm:num_requests_running",
    "pagellm_num_requests_waiting": "vllm:num_requests_waiting",
    "pagellm_num_preemptions_total": "vllm:num_preemptions_total",
    "pagellm_prompt_tokens_total": "vllm:prompt_tokens_total",
    "pagellm_generation_tokens_total": "vllm:generation_tokens_total",
    "pagellm_request_finished_total": "vllm:request_success_total",
    "pagellm_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "pagellm_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "pagellm_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
}


# Sizes past which a logged value is cut: a schema, a token list or a stop string may
# be megabytes, and a log line per request must stay a line.
_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother = 3, 80, 80
_BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxdict = _BRIEF.maxset = 8


def _brief(value: object) -> str:
    """Sampling params as a log line shows them, field by field (nested formats too),
    each value cut to a few items or characters."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(f"{field.name}={_brief(getattr(value, field.name))}"
                           for field in dataclasses.fields(value))
        return f"{type(value).__name__}({fields})"
    return _BRIEF.repr(value)


def _request_summary(output: RequestOutput) -> str:
    """A request's tokens and times as a log line tells them: how much of its prompt
    came from the prefix cache is what an operator looks for when it is slow."""
    metrics = output.metrics
    text = (f"{len(output.prompt_token_ids)} prompt tokens ({output.num_cached_tokens} from "
            f"the prefix cache), "
            f"{sum(len(c.token_ids) for c in output.outputs)} generated")
    if metrics is not None and metrics.first_token_time is not None:
        end = metrics.finished_time or metrics.last_token_time or metrics.first_token_time
        text += (f", first token after {metrics.first_token_time - metrics.arrival_time:.3f} s"
                 f", {end - metrics.arrival_time:.3f} s in all")
    return text


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{key}="{_escape(value)}"' for key, value in labels.items()) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


def _family(name: str, kind: str, help_text: str, samples: Iterable[str]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


class Histogram:
    """A cumulative-bucket histogram, as Prometheus expects it."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.help_text = help_text
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def render(self, labels: dict[str, str]) -> list[str]:
        samples = []
        cumulative = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            cumulative += count
            bucket_labels = _labels({**labels, "le": _number(bound)})
            samples.append(f"{self.name}_bucket{bucket_labels} {cumulative}")
        samples.append(f"{self.name}_sum{_labels(labels)} {_number(self.sum)}")
        samples.append(f"{self.name}_count{_labels(labels)} {cumulative}")
        return _family(self.name, "histogram", self.help_text, samples)


class ServerMetrics:
    """The server's metrics: engine counters and gauges, plus request latency histograms;
    with `log_requests` (vLLM's --enable-log-requests), also a log line per request as it
    arrives and as it ends, saying what the prefix cache gave it."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str,
                 log_requests: bool = False) -> None:
        self.engine = engine
        self.labels = {"model_name": model_name}
        self.log_requests = log_requests
        self.time_to_first_token = Histogram(
            "pagellm_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.", TTFT_BUCKETS)
        self.inter_token_latency = Histogram(
            "pagellm_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.", ITL_BUCKETS)
        self.e2e_request_latency = Histogram(
            "pagellm_e2e_request_latency_seconds",
            "Time from a request's arrival to its last token (finished requests only).",
            E2E_BUCKETS)
        # Completions by how they ended: "stop", "length", or "abort" (unfinished).
        self.requests_finished: dict[str, int] = {}

    def observe_finished(self, output: RequestOutput) -> None:
        """Records a finished request, per completion (as vLLM counts an n > 1 request's
        samples), so every histogram's count agrees with the finish-reason counter."""
        metrics = output.metrics
        end = None if metrics is None else metrics.finished_time or metrics.last_token_time
        for completion in output.outputs:
            self._observe_tokens(output, len(completion.token_ids))
            if metrics is not None and end is not None:
                self.e2e_request_latency.observe(end - metrics.arrival_time)
            self._finished(completion.finish_reason or FINISHED_ABORT)
        if self.log_requests:
            reasons = ", ".join(sorted({c.finish_reason or FINISHED_ABORT
                                        for c in output.outputs}))
            logger.info("request %s finished (%s): %s", output.request_id, reasons,
                        _request_summary(output))

    def observe_aborted(self, request_id: str, output: RequestOutput | None,
                        num_samples: int) -> None:
        """Records a request that ended unfinished (its client left, the server shut
        down, the engine failed it): the tokens it produced count in the token latencies;
        its end-to-end time is not a completion's and does not."""
        if self.log_requests:
            logger.info("request %s aborted: %s", request_id,
                        "before its first token" if output is None
                        else _request_summary(output))
        if output is None:
            for _ in range(num_samples):
                self._finished(FINISHED_ABORT)
            return
        for completion in output.outputs:
            self._observe_tokens(output, len(completion.token_ids))
            self._finished(completion.finish_reason or FINISHED_ABORT)

    def _observe_tokens(self, output: RequestOutput, num_tokens: int) -> None:
        """One completion's time to first token and gaps between its `num_tokens` tokens
        (the request's step times; samples of one request advance together)."""
        metrics = output.metrics
        if metrics is None or metrics.first_token_time is None or not num_tokens:
            return
        self.time_to_first_token.observe(metrics.first_token_time - metrics.arrival_time)
        times = metrics.token_times[:num_tokens]
        for earlier, later in zip(times, times[1:], strict=False):
            self.inter_token_latency.observe(later - earlier)

    def observe_received(self, request_id: str, num_prompt_tokens: int,
                         params: object) -> None:
        if self.log_requests:
            logger.info("request %s received: %d prompt tokens, %s", request_id,
                        num_prompt_tokens, _brief(params))

    def _finished(self, reason: str) -> None:
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1

    def render(self) -> str:
        stats = self.engine.stats()
        labels = self.labels
        families: dict[str, list[str]] = {}

        def scalar(name: str, kind: str, help_text: str, value: float) -> None:
            families[name] = _family(name, kind, help_text,
                                     [f"{name}{_labels(labels)} {_number(value)}"])

        scalar("pagellm_prefix_cache_queries_total", "counter",
               "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries)
        scalar("pagellm_prefix_cache_hits_total", "counter",
               "Prompt tokens served from the prefix cache.", stats.prefix_cache_hits)
        scalar("pagellm_prefix_cache_evictions_total", "counter",
               "Cached KV blocks evicted to make room.", stats.num_evictions)
        scalar("pagellm_kv_cache_usage", "gauge",
               "Fraction of KV cache blocks in use (0 when idle).", stats.kv_cache_usage)
        scalar("pagellm_kv_cache_blocks", "gauge",
               "KV cache blocks in the pool.", stats.num_blocks)
        scalar("pagellm_num_requests_running", "gauge",
               "Requests scheduled in the running batch.", stats.num_running)
        scalar("pagellm_num_requests_waiting", "gauge",
               "Requests waiting to be scheduled.", stats.num_waiting)
        scalar("pagellm_num_preemptions_total", "counter",
               "Requests preempted (their KV freed) to make room.", stats.num_preemptions)
        scalar("pagellm_prompt_tokens_total", "counter",
               "Prompt tokens of requests whose prompt was computed (cached ones "
               "included).", stats.prompt_tokens)
        scalar("pagellm_generation_tokens_total", "counter",
               "Tokens generated.", stats.generation_tokens)
        families["pagellm_request_finished_total"] = _family(
            "pagellm_request_finished_total", "counter",
            "Completions ended, by finish reason (abort: unfinished, e.g. the client left).",
            [f"pagellm_request_finished_total{_labels({**labels, 'finished_reason': reason})} "
             f"{self.requests_finished.get(reason, 0)}"
             for reason in sorted({*FINISH_REASONS, *self.requests_finished})])
        for histogram in (self.time_to_first_token, self.inter_token_latency,
                          self.e2e_request_latency):
            families[histogram.name] = histogram.render(labels)
        lines = [line for family in families.values() for line in family]
        # Each line names its family first (# HELP/# TYPE name, name{...}, name_bucket).
        lines += [line.replace(name, VLLM_NAMES[name], 1) for name, family in families.items()
                  if name in VLLM_NAMES for line in family]
        return "\n".join(lines) + "\n"
