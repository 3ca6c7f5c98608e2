"""Prometheus metrics of the REST API, on a registry of its own (never the global one).

Names follow the house rule ``overtake_<subsystem>_<name>_<unit>``: counters end in ``_total``,
durations are in seconds, labels are bounded (route templates, not raw paths).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

KINDS = ("model", "fit")
STATUSES = ("queued", "running", "done", "failed", "cancelled")


class _JobGauge(Collector):
    """``overtake_api_jobs{kind,status}``: jobs in the store now, read at scrape time."""

    def __init__(self, counts: Callable[[], dict[tuple[str, str], int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily("overtake_api_jobs", "Jobs in the store by kind and status", labels=["kind", "status"])
        counts = self._counts()
        for k in KINDS:
            for s in STATUSES:
                g.add_metric([k, s], counts.get((k, s), 0))
        yield g


class ApiMetrics:
    """The API's instruments; label values pre-created so known series exist at zero."""

    def __init__(self, counts: Callable[[], dict[tuple[str, str], int]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("overtake_api_http_requests_total", "HTTP requests answered",
                                ["method", "route", "code"], registry=r)
        self.latency = Histogram("overtake_api_http_request_duration_seconds", "Time to answer a request",
                                 ["route"], registry=r,
                                 buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5))
        self.submitted = Counter("overtake_api_jobs_submitted_total", "Jobs queued (a 202 naming a new job)", ["kind"],
                                 registry=r)
        self.rejected = Counter("overtake_api_jobs_rejected_total", "Jobs refused", ["kind", "reason"], registry=r)
        self.decisions = Counter("overtake_api_decisions_total", "Decision queries answered", registry=r)
        for k in KINDS:
            self.submitted.labels(k)
            for reason in ("invalid", "too_large", "queue_full"):
                self.rejected.labels(k, reason)
        r.register(_JobGauge(counts))


class InstrumentMiddleware:
    """Pure ASGI middleware counting requests by route template and timing them.

    (Starlette's ``BaseHTTPMiddleware`` costs a task and a stream per request; this costs two
    dictionary lookups.)
    """

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(scope["method"], path, str(status)).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - t0)
