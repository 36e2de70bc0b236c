"""Prometheus metrics of `boosttune serve` (GET /metrics), in a registry of the app's own.

Throughput is ``rate(boosttune_generated_tokens_total[1m])``; per-request speed, τ and latency are
histograms; the queue depth is read from the worker when scraped.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TAU_BUCKETS = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8)
_TPS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


class ServerMetrics:
    """The server's counters, gauges and histograms."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_depth: Callable[[], float]):
        """``queue_depth``: returns the number of waiting requests when scraped."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter("boosttune_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.latency = Histogram("boosttune_request_latency_seconds", "Request latency, to the last byte (streams included)",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.time_to_first_token = Histogram("boosttune_time_to_first_token_seconds", "Seconds from submission to the first "
                                             "generated token", buckets=_LATENCY_BUCKETS, registry=r)
        self.generated_tokens = Counter("boosttune_generated_tokens", "Tokens generated (counted as they are, so "
                                        "abandoned requests count what they made)", registry=r)
        self.prompt_tokens = Counter("boosttune_prompt_tokens", "Prompt tokens processed", registry=r)
        self.tokens_per_second = Histogram("boosttune_tokens_per_second", "Per request: generated tokens / engine seconds",
                                           buckets=_TPS_BUCKETS, registry=r)
        self.last_tokens_per_second = Gauge("boosttune_last_tokens_per_second", "tokens/s of the last finished request",
                                            registry=r)
        self.tau = Histogram("boosttune_tau", "Per request: tokens committed per LLM forward (bonus included)",
                             buckets=_TAU_BUCKETS, registry=r)
        self.last_tau = Gauge("boosttune_last_tau", "tau of the last finished request", registry=r)
        self.queue_depth = Gauge("boosttune_queue_depth", "Requests waiting for the engine", registry=r)
        self.queue_depth.set_function(queue_depth)
        self.active = Gauge("boosttune_active_requests", "Generation requests in flight (waiting or running)", registry=r)
        self.cancelled = Counter("boosttune_cancelled_requests", "Requests abandoned because the client disconnected",
                                 registry=r)
        self.failed = Counter("boosttune_failed_requests", "Requests the engine failed on", registry=r)

    def observe_result(self, generated: int, prompt: int, engine_seconds: float, tau: float) -> None:
        """Record one finished generation (its tokens were counted as they were generated)."""
        self.prompt_tokens.inc(prompt)
        if engine_seconds > 0:
            tps = generated / engine_seconds
            self.tokens_per_second.observe(tps)
            self.last_tokens_per_second.set(tps)
        self.tau.observe(tau)
        self.last_tau.set(tau)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestMetricsMiddleware:
    """ASGI middleware: counts every HTTP request by endpoint and status and times it to its last byte."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, endpoints: frozenset[str]):
        """``endpoints``: paths counted under their own name; any other path counts as "other"."""
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self.endpoints else "other"
        start = time.perf_counter()
        status = 500
        recorded = False

        def record() -> None:
            nonlocal recorded
            if not recorded:
                recorded = True
                self.metrics.requests.labels(endpoint, str(status)).inc()
                self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                record()

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            record()  # a stream cut short by the client still counts
