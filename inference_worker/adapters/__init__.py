"""Adapters in the worker: reference parsing (`refs`), fetches from the store (`store_source`,
`fetcher`), the GPU slot and pinned CPU tiers (`tiers`), versions and invalidation (`versions`),
residency publishing (`residency`, `coordinator_sync`), all under one lock in `pool`; the engine and
the service reach them through `WorkerAdapters`."""

from loraserve.inference_worker.adapters.metrics import AdapterMetrics
from loraserve.inference_worker.adapters.pool import AdapterPool
from loraserve.inference_worker.adapters.refs import AdapterRef
from loraserve.inference_worker.adapters.worker_adapters import WorkerAdapters

__all__ = ["AdapterMetrics", "AdapterPool", "AdapterRef", "WorkerAdapters"]
