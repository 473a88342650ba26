"""Prometheus metrics of one store (its own registry, so several stores can share a process)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class StoreMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.registrations = Counter(
            "loraserve_store_registrations", "RegisterAdapter outcomes", ["outcome"], registry=r
        )
        self.builds = Counter(
            "loraserve_store_builds", "checkpoints read, validated and optimized", ["reason"], registry=r
        )
        self.build_seconds = Histogram(
            "loraserve_store_build_seconds", "time to read, validate and optimize", registry=r
        )
        self.fetches = Counter("loraserve_store_fetches", "FetchAdapter streams started", registry=r)
        self.fetch_bytes = Counter("loraserve_store_fetch_bytes", "payload bytes streamed", registry=r)
        self.cache_hits = Counter(
            "loraserve_store_cache_hits", "fetches served from the CPU cache", registry=r
        )
        self.cache_misses = Counter(
            "loraserve_store_cache_misses", "fetches that rebuilt from the source", registry=r
        )
        self.cache_evictions = Counter(
            "loraserve_store_cache_evictions", "adapters evicted from the CPU cache", registry=r
        )
        self.cache_adapters = Gauge("loraserve_store_cache_adapters", "adapters in the CPU cache", registry=r)
        self.cache_bytes = Gauge("loraserve_store_cache_bytes", "bytes in the CPU cache", registry=r)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of a sample, e.g. value("loraserve_store_builds_total", {"reason": "register"})."""
        v = self.registry.get_sample_value(name, labels or {})
        return float(v or 0.0)

    def serve(self, port: int, host: str = "0.0.0.0") -> Any:
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
