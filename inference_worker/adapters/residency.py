"""Residency publishing: this worker's tiers and pins mirrored to the coordinator.

The step thread and the admin calls only mark what changed (under the adapters' state lock, no
network); `flush` (run by the coordinator sync thread) writes the marked adapters' residency and
the pin changes, adapters used since the last flush stamped with one tick of the cluster-wide
LRU clock. A flush that finds the coordinator unreachable costs only staleness: the Redis
coordinator keeps a shadow of what was written and republishes it when Redis answers again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from loraserve.inference_worker.coordination import Coordinator, Residency

# (digest, tier, slot) of where the worker holds an adapter now, None when nowhere
Where = Callable[[str], tuple[str, str, int] | None]


class ResidencyPublisher:
    def __init__(self, coordinator: Coordinator, worker_id: str, lock: threading.RLock, where: Where) -> None:
        self.coordinator, self.worker_id = coordinator, worker_id
        self._lock, self._where = lock, where
        self._dirty: set[str] = set()  # adapter ids whose residency changed since the last flush
        self._used: set[str] = set()  # adapter ids used since the last flush
        self._pins: dict[str, bool] = {}  # pin changes since the last flush
        self._cluster_last_used: dict[str, int] = {}

    # ------------------------------------------------------------------ under the state lock
    def changed(self, adapter_id: str) -> None:
        self._dirty.add(adapter_id)

    def used(self, adapter_id: str) -> None:
        self._used.add(adapter_id)

    def pinned(self, adapter_id: str, pinned: bool) -> None:
        self._pins[adapter_id] = pinned

    # ------------------------------------------------------------------ sync thread
    def flush(self) -> int:
        """Write what changed since the last flush; returns how many residency entries."""
        with self._lock:
            dirty, used, pins = self._dirty | self._used, self._used, self._pins
            self._dirty, self._used, self._pins = set(), set(), {}
            entries = [(adapter_id, self._where(adapter_id)) for adapter_id in sorted(dirty)]
        for adapter_id, pinned in pins.items():
            self.coordinator.set_pin(self.worker_id, adapter_id, pinned)
        if not entries:
            return 0
        tick = self.coordinator.tick() if used else 0
        for adapter_id, where in entries:
            if where is None:
                self._cluster_last_used.pop(adapter_id, None)
                self.coordinator.drop_residency(self.worker_id, adapter_id)
                continue
            if adapter_id in used:
                self._cluster_last_used[adapter_id] = tick
            digest, tier, slot = where
            last = self._cluster_last_used.get(adapter_id, 0)
            self.coordinator.put_residency(Residency(self.worker_id, adapter_id, digest, tier, slot, last))
        return len(entries)
