"""Prometheus metrics of the adapter tiers, registered on the worker's registry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from loraserve.inference_worker.adapters.usage_metrics import AdapterUsageMetrics

LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class AdapterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else CollectorRegistry()
        self.registry = reg
        self.loads = Counter(
            "loraserve_worker_adapter_loads",
            "Adapter loads: tier=cpu is a fetch from the store into the "
            "CPU cache, tier=gpu a copy into a GPU slot; result is ok or the failure's status code.",
            ["tier", "result"],
            registry=reg,
        )
        self.load_seconds = Histogram(
            "loraserve_worker_adapter_load_seconds",
            "Adapter load latency by tier.",
            ["tier"],
            buckets=LOAD_BUCKETS,
            registry=reg,
        )
        self.fetch_transport = Counter(
            "loraserve_worker_adapter_fetch_transport",
            "Adapters fetched from the store by how the payload came: stream (gRPC), file (handed "
            "over on the store's host), missed (a hand-over file this worker could not read, streamed).",
            ["how"],
            registry=reg,
        )
        self.evictions = Counter(
            "loraserve_worker_adapter_evictions",
            "Adapters evicted from a tier to make room.",
            ["tier"],
            registry=reg,
        )
        self.invalidations = Counter(
            "loraserve_worker_adapter_invalidations",
            "Adapter versions dropped because the store re-registered or deleted them.",
            registry=reg,
        )
        self.lookups = Counter(
            "loraserve_worker_adapter_lookups",
            "Admission lookups by where the adapter was found (gpu, cpu, miss).",
            ["result"],
            registry=reg,
        )
        self.requests = Counter(
            "loraserve_worker_adapter_requests",
            "Requests for an adapter by where it was when they arrived (gpu, cpu, store): the share "
            "served from a resident adapter, counted once per request.",
            ["tier"],
            registry=reg,
        )
        self.slots_used = Gauge(
            "loraserve_worker_adapter_slots_used", "GPU adapter slots holding an adapter.", registry=reg
        )
        self.slots_total = Gauge(
            "loraserve_worker_adapter_slots", "GPU adapter slots (max_loras).", registry=reg
        )
        self.slots_pinned = Gauge(
            "loraserve_worker_adapter_slots_pinned", "GPU adapter slots pinned.", registry=reg
        )
        self.cpu_adapters = Gauge(
            "loraserve_worker_adapter_cpu_cached", "Adapters in the CPU cache.", registry=reg
        )
        self.cpu_bytes = Gauge(
            "loraserve_worker_adapter_cpu_cache_bytes", "Bytes of the CPU cache.", registry=reg
        )
        self.per_adapter: AdapterUsageMetrics | None = None  # the worker's per-adapter series

    def observe_load(self, tier: str, adapter_id: str, seconds: float) -> None:
        """A successful load into `tier` (cpu: fetched from the store, gpu: copied into a slot)."""
        self.loads.labels(tier, "ok").inc()
        self.load_seconds.labels(tier).observe(seconds)
        if self.per_adapter is not None:
            self.per_adapter.observe_load(adapter_id, tier, seconds)

    def register_on(self, registry: CollectorRegistry) -> None:
        for c in (
            self.loads,
            self.load_seconds,
            self.evictions,
            self.invalidations,
            self.lookups,
            self.slots_used,
            self.slots_total,
            self.slots_pinned,
            self.cpu_adapters,
            self.cpu_bytes,
        ):
            registry.register(c)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of one sample (tests and ListAdapters-style reporting)."""
        v = self.registry.get_sample_value(name, labels or {})
        return 0.0 if v is None else float(v)
