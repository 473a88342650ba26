"""Background upkeep of the adapter manager on the event loop: apply invalidation events, notice
adapters re-registered or deleted at the store (and publish that as an invalidation event, so
every worker sharing the coordinator drops its copy), and keep this worker's heartbeat alive."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from inference_worker.adapters.manager import AdapterManager
from inference_worker.errors import WorkerError

log = logging.getLogger(__name__)


class Watcher:
    def __init__(self, manager: AdapterManager, *, list_digests: Callable[[], Awaitable[dict[str, str]]] | None,
                 address: str = "", interval_s: float = 2.0, heartbeat_ttl_s: float = 10.0) -> None:
        self.manager = manager
        self._list_digests = list_digests
        self.address = address
        self.interval_s, self.heartbeat_ttl_s = interval_s, heartbeat_ttl_s
        self._task: asyncio.Task | None = None
        self._published: set[tuple[str, str]] = set()  # (id, digest) already announced

    async def check_store(self) -> int:
        """Compare what this worker holds with the store's registry; publish an invalidation for
        each adapter whose digest changed or that is gone. Returns how many were published."""
        if self._list_digests is None:
            return 0
        store = await self._list_digests()
        published = 0
        for adapter_id, digest in self.manager.known_digests().items():
            now = store.get(adapter_id, "")
            if now != digest and (adapter_id, now) not in self._published:
                reason = "registered" if now else "deleted"
                self.manager.coordinator.publish_invalidation(adapter_id, now, reason)
                self._published.add((adapter_id, now))
                published += 1
        await asyncio.to_thread(self.manager.poll_invalidations)
        return published

    def heartbeat(self) -> None:
        m = self.manager
        info: dict[str, float | int | str] = {
            "max_loras": m.slots.max_loras, "slots_used": m.table.num_used, "cpu_cached": len(m.cpu),
        }
        m.coordinator.heartbeat(m.worker_id, self.address, self.heartbeat_ttl_s, info)

    async def run(self) -> None:
        while True:
            try:
                # coordinator round trips (Redis) run off the event loop
                await asyncio.to_thread(self.manager.poll_invalidations)
                await asyncio.to_thread(self.manager.flush_residency)
                await asyncio.to_thread(self.heartbeat)
                await self.check_store()
            except WorkerError as exc:  # store unreachable: keep serving what we hold
                log.debug("adapter store check failed: %s", exc)
            except Exception:  # noqa: BLE001 - upkeep must not die; the next round retries
                log.exception("adapter upkeep failed")
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.manager.coordinator.release_worker(self.manager.worker_id)
