"""The HTTP and process series vLLM's server has beside the engine's: what its
prometheus-fastapi-instrumentator and prometheus_client's process collector expose, under
the same names, labels and buckets, for the generic alerts operators run on any web
service (the share of 5xx answers, a route's latency, the server's memory).
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field

import psutil
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.engine.metrics import Counter, Gauge, LatencyHistogram, Metric

# The instrumentator's default buckets: a coarse histogram with handler and method
# labels, and a fine one without labels.
DURATION_BUCKETS = (0.1, 0.5, 1.0)
DURATION_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
                          3.0, 3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0)
# The routes vLLM leaves out: probes and the metrics page itself.
EXCLUDED_HANDLERS = frozenset({"/metrics", "/health", "/load", "/ping", "/version"})
# Methods kept as labels; any other a client sends counts as "other", so a client
# cannot add series at will.
METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"})

# HELP lines, by record name (a counter's without `_total`).
HTTP_HELP = {
    "http_requests": "Total number of requests by method, status and handler.",
    "http_request_duration_seconds": "Latency with only few buckets by handler. Made to be "
                                     "only used if aggregation by handler is important.",
    "http_request_duration_highr_seconds": "Latency with many buckets but no API specific "
                                           "labels. Made for more accurate percentile "
                                           "calculations.",
    "process_cpu_seconds": "Total user and system CPU time spent in seconds.",
    "process_resident_memory_bytes": "Resident memory size in bytes.",
    "process_virtual_memory_bytes": "Virtual memory size in bytes.",
    "process_start_time_seconds": "Start time of the process since unix epoch in seconds.",
    "process_open_fds": "Number of open file descriptors.",
    "process_max_fds": "Maximum number of open file descriptors.",
}


@dataclass
class HttpMetrics:
    """Requests answered, by route template (a path no route matches is "none"),
    method and status class ("2xx"), and how long each took to its last byte."""

    requests: dict[tuple[str, str, str], int] = field(default_factory=dict)
    durations: dict[tuple[str, str], LatencyHistogram] = field(default_factory=dict)
    highr: LatencyHistogram = field(default_factory=lambda: LatencyHistogram(
        "http_request_duration_highr_seconds", DURATION_HIGHR_BUCKETS))

    def record(self, handler: str, method: str, status: int, seconds: float) -> None:
        key = (method, f"{status // 100}xx", handler)
        self.requests[key] = self.requests.get(key, 0) + 1
        histogram = self.durations.get((method, handler))
        if histogram is None:
            histogram = self.durations[(method, handler)] = LatencyHistogram(
                "http_request_duration_seconds", DURATION_BUCKETS)
        histogram.observe(seconds)
        self.highr.observe(seconds)

    def snapshot(self) -> list[Metric]:
        """The series in the text format's order, each family together; then the
        process's own."""
        return [
            *(Counter("http_requests", {"method": method, "status": status,
                                        "handler": handler}, count)
              for (method, status, handler), count in sorted(self.requests.items())),
            *(histogram.snapshot({"method": method, "handler": handler})
              for (method, handler), histogram in sorted(self.durations.items())),
            self.highr.snapshot({}),
            *process_metrics(),
        ]


def process_metrics() -> list[Metric]:
    """prometheus_client's process series, from psutil."""
    process = psutil.Process()
    memory = process.memory_info()
    cpu = process.cpu_times()
    return [
        Counter("process_cpu_seconds", {}, cpu.user + cpu.system),
        Gauge("process_resident_memory_bytes", {}, float(memory.rss)),
        Gauge("process_virtual_memory_bytes", {}, float(memory.vms)),
        Gauge("process_start_time_seconds", {}, process.create_time()),
        Gauge("process_open_fds", {}, float(process.num_fds())),
        Gauge("process_max_fds", {}, float(resource.getrlimit(resource.RLIMIT_NOFILE)[0])),
    ]


class HttpMetricsMiddleware:
    """Records each HTTP request in `metrics` when its answer is done (a stream's last
    byte too), under its route's template, as the instrumentator names it."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        handler = _handler(scope)
        if handler in EXCLUDED_HANDLERS:
            await self.app(scope, receive, send)
            return
        status = 500  # an app that fails before answering answers 500
        start = time.perf_counter()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            method = str(scope.get("method", ""))
            self.metrics.record(handler, method if method in METHODS else "other", status,
                                time.perf_counter() - start)


def _handler(scope: Scope) -> str:
    """The template of the route `scope` reaches ("/v1/models/{name:path}"), that of a
    route on its path for another method (a 405), or "none"."""
    app = scope.get("app")
    partial = "none"
    for route in getattr(getattr(app, "router", None), "routes", ()):
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return str(getattr(route, "path", "none"))
        if match == Match.PARTIAL and partial == "none":
            partial = str(getattr(route, "path", "none"))
    return partial
