"""The in-process coordinator: the same contract as the networked one, for a single process
(the embedded default and tests). Thread-safe: the engine's step thread and the asyncio loop
both use it."""

from __future__ import annotations

import threading
import time
import uuid

from loraserve.inference_worker.coordination.coordinator import (
    FIRST_EVENT_ID,
    InvalidationEvent,
    Residency,
    WorkerHeartbeat,
)


class InProcessCoordinator:
    def __init__(self, max_events: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._clock = 0
        self._residency: dict[tuple[str, str], Residency] = {}
        self._heartbeats: dict[str, WorkerHeartbeat] = {}
        self._pins: dict[str, set[str]] = {}
        self._popularity: dict[str, tuple[float, dict[str, float]]] = {}  # worker -> (expires, counts)
        self._events: list[InvalidationEvent] = []
        self._next_event_id = 1
        self._max_events = max_events
        self._epoch = uuid.uuid4().hex  # this state lives as long as the object: never lost

    def epoch(self) -> str:
        return self._epoch

    def tick(self) -> int:
        with self._lock:
            self._clock += 1
            return self._clock

    def put_residency(self, residency: Residency) -> None:
        with self._lock:
            self._residency[(residency.worker_id, residency.adapter_id)] = residency

    def drop_residency(self, worker_id: str, adapter_id: str) -> None:
        with self._lock:
            self._residency.pop((worker_id, adapter_id), None)

    def residencies(self, worker_id: str | None = None) -> list[Residency]:
        with self._lock:
            return [r for (w, _), r in self._residency.items() if worker_id is None or w == worker_id]

    def heartbeat(
        self, worker_id: str, address: str, ttl_s: float, info: dict[str, float | int | str]
    ) -> None:
        with self._lock:
            self._heartbeats[worker_id] = WorkerHeartbeat(
                worker_id, address, time.monotonic() + ttl_s, dict(info)
            )

    def live_workers(self) -> list[WorkerHeartbeat]:
        now = time.monotonic()
        with self._lock:
            for w in [w for w, hb in self._heartbeats.items() if hb.expires_at <= now]:
                del self._heartbeats[w]
            return list(self._heartbeats.values())

    def release_worker(self, worker_id: str) -> None:
        with self._lock:
            self._heartbeats.pop(worker_id, None)
            self._pins.pop(worker_id, None)
            self._popularity.pop(worker_id, None)
            for key in [k for k in self._residency if k[0] == worker_id]:
                del self._residency[key]

    def set_pin(self, worker_id: str, adapter_id: str, pinned: bool) -> None:
        with self._lock:
            pins = self._pins.setdefault(worker_id, set())
            if pinned:
                pins.add(adapter_id)
            else:
                pins.discard(adapter_id)

    def pins(self, worker_id: str) -> set[str]:
        with self._lock:
            return set(self._pins.get(worker_id, ()))

    def publish_popularity(self, worker_id: str, counts: dict[str, float], ttl_s: float) -> None:
        with self._lock:
            self._popularity[worker_id] = (time.monotonic() + ttl_s, dict(counts))

    def fleet_popularity(self) -> dict[str, float]:
        now = time.monotonic()
        total: dict[str, float] = {}
        with self._lock:
            for w in [w for w, (expires, _) in self._popularity.items() if expires <= now]:
                del self._popularity[w]
            for _, counts in self._popularity.values():
                for adapter_id, n in counts.items():
                    total[adapter_id] = total.get(adapter_id, 0.0) + n
        return total

    def publish_invalidation(self, adapter_id: str, digest: str, reason: str) -> str:
        with self._lock:
            event = InvalidationEvent(f"{self._next_event_id}-0", adapter_id, digest, reason)
            self._next_event_id += 1
            self._events.append(event)
            # A bounded log: readers further behind than max_events lose the oldest events,
            # as with a capped Redis Stream (MAXLEN ~).
            if len(self._events) > self._max_events:
                del self._events[: len(self._events) - self._max_events]
            return event.event_id

    def read_invalidations(
        self, after_id: str = FIRST_EVENT_ID, limit: int = 1000
    ) -> list[InvalidationEvent]:
        after = _order(after_id)
        with self._lock:
            return [e for e in self._events if _order(e.event_id) > after][:limit]


def _order(event_id: str) -> tuple[int, int]:
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq or 0)
