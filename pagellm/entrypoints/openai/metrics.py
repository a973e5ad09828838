"""Prometheus metrics at /metrics, in the text exposition format (written by hand).

The page prints the engine's metrics snapshot (engine/metrics.py), read from the stats the
engine took after its latest step when scraped: the engine keeps one source of truth,
latency histograms included, and the server adds nothing to its hot loop.
"""

from __future__ import annotations

import dataclasses
import logging
import reprlib
from collections.abc import Sequence

from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.metrics import (
    FINISHED_ABORT,
    HELP,
    VLLM_HELP,
    VLLM_NAMES,
    Counter,
    Gauge,
    Histogram,
    Metric,
    metrics_snapshot,
)
from pagellm.engine.outputs import RequestOutput
from pagellm.entrypoints.openai.http_metrics import HTTP_HELP, HttpMetrics

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

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
    return repr(float(value)) if isinstance(value, float) else str(value)


def _samples(metric: Metric, name: str) -> list[str]:
    """A record's sample lines under `name` (a counter's with `_total`)."""
    labels = _labels(metric.labels)
    if isinstance(metric, Histogram):
        return [*(f"{name}_bucket{_labels({**metric.labels, 'le': bound})} {count}"
                  for bound, count in metric.buckets.items()),
                f"{name}_sum{labels} {_number(metric.sum)}",
                f"{name}_count{labels} {metric.count}"]
    assert isinstance(metric, Counter | Gauge)
    return [f"{name}{labels} {_number(metric.value)}"]


def prometheus_text(metrics: Sequence[Metric]) -> str:
    """The metrics in Prometheus' text format: each family (the records sharing a name,
    which come together) under its HELP and TYPE lines, a counter's with `_total`."""
    vllm_names = {vllm: ours for ours, vllm in VLLM_NAMES.items()}
    help_texts = {**HELP, **HTTP_HELP, **VLLM_HELP}
    lines: list[str] = []
    for index, metric in enumerate(metrics):
        name = metric.name + "_total" if isinstance(metric, Counter) else metric.name
        if index == 0 or metrics[index - 1].name != metric.name:
            kind = ("histogram" if isinstance(metric, Histogram)
                    else "counter" if isinstance(metric, Counter) else "gauge")
            meaning = help_texts.get(metric.name) or help_texts[vllm_names[metric.name]]
            lines += [f"# HELP {name} {meaning}",
                      f"# TYPE {name} {kind}"]
        lines += _samples(metric, name)
    return "\n".join(lines) + "\n"


class ServerMetrics:
    """The server's /metrics page (the engine's snapshot, which records every request's
    latencies itself) and, with `log_requests` (vLLM's --enable-log-requests), a log
    line per request as it arrives and as it ends, saying what the prefix cache gave
    it, and with `log_outputs` what it generated."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, log_requests: bool = False,
                 log_outputs: bool = False, max_log_len: int | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.http = HttpMetrics()  # filled by the app's HttpMetricsMiddleware
        self.log_requests = log_requests or log_outputs
        self.log_outputs = log_outputs
        self.max_log_len = max_log_len

    def log_received(self, request_id: str, num_prompt_tokens: int, params: object) -> None:
        if self.log_requests:
            logger.info("request %s received: %d prompt tokens, %s", request_id,
                        num_prompt_tokens, _brief(params))

    def log_finished(self, output: RequestOutput) -> None:
        if self.log_requests:
            reasons = ", ".join(sorted({c.finish_reason or FINISHED_ABORT
                                        for c in output.outputs}))
            logger.info("request %s finished (%s): %s%s", output.request_id, reasons,
                        _request_summary(output), self._outputs(output))

    def log_aborted(self, request_id: str, output: RequestOutput | None) -> None:
        """A request that ended unfinished (its client left, the server shut down, the
        engine failed it), with the latest output its handler saw, if any."""
        if self.log_requests:
            logger.info("request %s aborted: %s", request_id,
                        "before its first token" if output is None
                        else _request_summary(output) + self._outputs(output))

    def _outputs(self, output: RequestOutput) -> str:
        """The generated texts for the log, each cut to max_log_len characters."""
        if not self.log_outputs:
            return ""
        return "".join(f", output {c.index}: {c.text[:self.max_log_len]!r}"
                       for c in output.outputs)

    def render(self) -> str:
        return prometheus_text(metrics_snapshot(self.engine.stats(), self.model_name)
                               + self.http.snapshot())
