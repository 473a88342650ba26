"""Prometheus metrics of the gateway, in their own registry (tests run several gateways in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "loraserve_gateway_requests",
            "HTTP API requests by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "loraserve_gateway_request_seconds",
            "Arrival to the response's end, by endpoint",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "loraserve_gateway_time_to_first_token_seconds",
            "Arrival to the first streamed token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.relay = Histogram(
            "loraserve_gateway_delta_relay_seconds",
            "A worker delta's arrival to its server-sent event handed to the HTTP connection (what the "
            "gateway adds to each streamed token)",
            buckets=(
                1e-5,
                2.5e-5,
                5e-5,
                1e-4,
                2.5e-4,
                5e-4,
                1e-3,
                2.5e-3,
                5e-3,
                0.01,
                0.025,
                0.05,
                0.1,
                0.25,
                1,
            ),
            registry=r,
        )
        self.tokens = Counter(
            "loraserve_gateway_completion_tokens", "Tokens generated for the gateway's clients", registry=r
        )
        self.in_flight = Gauge("loraserve_gateway_requests_in_flight", "Requests being served", registry=r)
        self.disconnects = Counter(
            "loraserve_gateway_client_disconnects",
            "Requests whose client went away before the end (their generation is cancelled)",
            registry=r,
        )
