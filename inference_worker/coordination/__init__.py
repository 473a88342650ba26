"""Coordination between workers and the store: residency, LRU clock, heartbeats, pins and
invalidation events. `InProcessCoordinator` stands in when no Redis is configured."""

from loraserve.inference_worker.coordination.coordinator import (
    FIRST_EVENT_ID,
    Coordinator,
    InvalidationEvent,
    Residency,
    WorkerHeartbeat,
)
from loraserve.inference_worker.coordination.in_process import InProcessCoordinator

__all__ = [
    "FIRST_EVENT_ID",
    "Coordinator",
    "InProcessCoordinator",
    "InvalidationEvent",
    "Residency",
    "WorkerHeartbeat",
]
