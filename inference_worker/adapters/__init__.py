"""Adapters in the worker: the GPU slot and pinned CPU tiers, single-flight fetches from the
store, pins, invalidation, and the admission policy the engine consults. The store client
(`store_source.StoreSource`) is imported where used: it needs the gRPC stubs."""

from inference_worker.adapters.manager import AdapterManager, parse_ref
from inference_worker.adapters.metrics import AdapterMetrics
from inference_worker.adapters.worker_adapters import WorkerAdapters

__all__ = ["AdapterManager", "AdapterMetrics", "WorkerAdapters", "parse_ref"]
