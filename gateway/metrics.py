"""The gateway's Prometheus metrics, on `GET /metrics` (a registry per app, so that tests can
build several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pagedserve:gateway_requests",
            "Completion requests answered, by endpoint and HTTP status (499: the client left)",
            ["endpoint", "status"], registry=self.registry,
        )  # fmt: skip
        self.duration = Histogram(
            "pagedserve:gateway_request_duration_seconds",
            "From the request's arrival to its last byte, by endpoint",
            ["endpoint"], buckets=_SECONDS, registry=self.registry,
        )  # fmt: skip
        self.first_token = Histogram(
            "pagedserve:gateway_time_to_first_token_seconds",
            "From the request's arrival to the router's first message (whole answer when not "
            "streamed), by endpoint",
            ["endpoint"], buckets=_SECONDS, registry=self.registry,
        )  # fmt: skip
        self.in_flight = Gauge(
            "pagedserve:gateway_requests_in_flight",
            "Completion requests being answered", registry=self.registry,
        )  # fmt: skip
