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
            "loraserve_store_cache_misses",
            "fetches not in the CPU cache (read from disk or rebuilt)",
            registry=r,
        )
        self.cache_evictions = Counter(
            "loraserve_store_cache_evictions", "adapters evicted from the CPU cache", registry=r
        )
        self.cache_adapters = Gauge("loraserve_store_cache_adapters", "adapters in the CPU cache", registry=r)
        self.cache_bytes = Gauge("loraserve_store_cache_bytes", "bytes in the CPU cache", registry=r)
        # Where a fetch's payload came from: memory (the CPU cache), disk (the disk tier) or source
        # (fetched, validated and optimized again); the time until the payload starts streaming (a disk
        # read streams while it fills).
        self.fetch_open_seconds = Histogram(
            "loraserve_store_fetch_open_seconds",
            "time from FetchAdapter to its payload starting to stream, by where the payload came from",
            ["origin"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r,
        )
        # the disk tier (disk_tier.py)
        self.disk_hits = Counter(
            "loraserve_store_disk_hits", "CPU cache misses served from the disk tier", registry=r
        )
        self.disk_misses = Counter(
            "loraserve_store_disk_misses", "CPU cache misses the disk tier could not serve", registry=r
        )
        self.disk_corrupt = Counter(
            "loraserve_store_disk_corrupt", "disk tier files found damaged and removed", registry=r
        )
        self.disk_errors = Counter(
            "loraserve_store_disk_errors", "disk tier operations that failed", ["op"], registry=r
        )
        self.disk_evictions = Counter(
            "loraserve_store_disk_evictions", "disk tier files evicted by the byte bound", registry=r
        )
        self.disk_orphans = Counter(
            "loraserve_store_disk_orphans",
            "disk tier files of unknown adapters removed at start-up",
            registry=r,
        )
        self.disk_read_bytes = Counter(
            "loraserve_store_disk_read_bytes", "payload bytes read from the disk tier", registry=r
        )
        self.disk_written_bytes = Counter(
            "loraserve_store_disk_written_bytes", "payload bytes written to the disk tier", registry=r
        )
        self.disk_payloads = Gauge(
            "loraserve_store_disk_payloads", "payload files in the disk tier", registry=r
        )
        self.disk_bytes = Gauge("loraserve_store_disk_bytes", "bytes of the disk tier's files", registry=r)
        # payloads handed over as files to workers on the store's host (handover.py)
        self.handovers = Counter(
            "loraserve_store_handovers",
            "fetches answered with a hand-over file, by whether it was written for it, already "
            "there, or could not be written (the fetch streamed)",
            ["outcome"],
            registry=r,
        )
        self.handover_written_bytes = Counter(
            "loraserve_store_handover_written_bytes", "payload bytes written as hand-over files", registry=r
        )
        self.handover_evictions = Counter(
            "loraserve_store_handover_evictions", "hand-over files removed by the byte bound", registry=r
        )
        self.handover_files = Gauge("loraserve_store_handover_files", "hand-over files", registry=r)
        self.handover_bytes = Gauge("loraserve_store_handover_bytes", "bytes of hand-over files", registry=r)
        # a registry in Redis that lost its data, and what the store's copy of it put back
        # (registry_mirror.py): from_copy, other_store (a copy that knew as much was put back
        # already), copy_unreadable (nothing put back)
        self.registry_restores = Counter(
            "loraserve_store_registry_restores",
            "losses of the registry's data in Redis this store found, by what it put back",
            ["outcome"],
            registry=r,
        )
        self.registry_restored_adapters = Counter(
            "loraserve_store_registry_restored_adapters",
            "adapters put back into Redis's registry from the store's copy",
            registry=r,
        )

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of a sample, e.g. value("loraserve_store_builds_total", {"reason": "register"})."""
        v = self.registry.get_sample_value(name, labels or {})
        return float(v or 0.0)

    def serve(self, port: int, host: str = "0.0.0.0") -> Any:
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
