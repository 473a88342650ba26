"""The adapters' only path to the coordinator (Redis): one background thread, so neither the
engine's step loop nor the event loop ever waits on the network.

It reads invalidation events from the stream cursor every `poll_s` and applies them, publishes
invalidations that the store check queued, and every `interval_s` writes this worker's residency,
pins, heartbeat and decayed per-adapter request counts, then hands the fleet's summed counts
(merged with its memory of them, `popularity.FleetMemory`, so a worker that leaves does not take
what its counts told the fleet with it), live workers and residency (`placement.FleetView`) to
`on_fleet_popularity` (popularity prefetch). A frozen or unreachable Redis stalls only this
thread: the worker keeps serving what it holds and its view of the cluster is stale by at most the
stall, then reconciles (the cursor resumes where it stopped; the Redis coordinator republishes its
shadow). A coordinator that lost its state (its epoch changed: Redis restarted with no persistence,
or flushed) lost the invalidations this worker had not read yet, too: `on_state_lost` then has the
worker compare what it holds with the store's registry at once (store_check.py); an empty Redis is
never read as adapters deleted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from loraserve.inference_worker.adapters.placement import FleetView
from loraserve.inference_worker.adapters.popularity import FleetMemory
from loraserve.inference_worker.coordination import FIRST_EVENT_ID, Coordinator
from loraserve.inference_worker.coordination.coordinator import InvalidationEvent

log = logging.getLogger(__name__)

POLL_S = 0.05  # invalidation events are read at least this often


class CoordinatorSync:
    def __init__(
        self,
        coordinator: Coordinator,
        *,
        apply: Callable[[InvalidationEvent], None],
        flush_residency: Callable[[], int],
        heartbeat_info: Callable[[], dict[str, float | int | str]],
        worker_id: str,
        address: str = "",
        interval_s: float = 2.0,
        poll_s: float = POLL_S,
        heartbeat_ttl_s: float = 10.0,
        popularity: Callable[[], dict[str, float]] | None = None,
        on_fleet_popularity: Callable[[FleetView], object] | None = None,
        fleet_memory: FleetMemory | None = None,
        on_state_lost: Callable[[], object] | None = None,
    ) -> None:
        self.coordinator, self.worker_id, self.address = coordinator, worker_id, address
        self._apply, self._flush, self._info = apply, flush_residency, heartbeat_info
        self.interval_s, self.poll_s, self.heartbeat_ttl_s = interval_s, poll_s, heartbeat_ttl_s
        self._popularity, self._on_fleet = popularity, on_fleet_popularity
        self._memory = fleet_memory
        self._on_lost = on_state_lost
        self._epoch = ""  # the coordinator's epoch seen last ("" before the first round)
        self._cursor = FIRST_EVENT_ID
        self._outbox: list[tuple[str, str, str]] = []  # invalidations to publish
        self._outbox_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ one round each
    def poll_invalidations(self) -> int:
        """Apply the events published since the last poll; returns how many."""
        events = self.coordinator.read_invalidations(self._cursor)
        for e in events:
            self._apply(e)
            self._cursor = e.event_id
        return len(events)

    def publish_queued(self) -> int:
        """Publish the queued invalidations in order; returns how many went out. One the
        coordinator could not take (Redis unreachable: no event id) stays queued with those after
        it for the next round: the store check announces a change once, so a dropped one would
        leave every worker's stale copy in place for good."""
        with self._outbox_lock:
            queued, self._outbox = self._outbox, []
        for i, (adapter_id, digest, reason) in enumerate(queued):
            if not self.coordinator.publish_invalidation(adapter_id, digest, reason):
                with self._outbox_lock:
                    self._outbox[:0] = queued[i:]
                return i
        return len(queued)

    def check_epoch(self) -> bool:
        """Whether the coordinator lost its state since the last round (its epoch changed); then
        `on_state_lost` runs. An unreadable epoch ("") changes nothing."""
        epoch = self.coordinator.epoch()
        lost = bool(epoch and self._epoch and epoch != self._epoch)
        if epoch:
            self._epoch = epoch
        if lost:
            log.warning("coordinator state lost (epoch changed): checking the adapters held with the store")
            if self._on_lost is not None:
                self._on_lost()
        return lost

    def flush_residency(self) -> int:
        return self._flush()

    def heartbeat(self) -> None:
        self.coordinator.heartbeat(self.worker_id, self.address, self.heartbeat_ttl_s, self._info())

    @property
    def placement_key(self) -> str:
        """This worker's key in the fleet's rendezvous placement: its address, as routers know it."""
        return self.address or self.worker_id

    def share_popularity(self) -> None:
        """Publish this worker's counts (kept for a few rounds), read the fleet's counts and
        residency, act on them."""
        if self._popularity is not None:
            ttl = max(3 * self.interval_s, self.heartbeat_ttl_s)
            self.coordinator.publish_popularity(self.worker_id, self._popularity(), ttl)
        if self._on_fleet is not None:
            remember = self._memory.merge if self._memory is not None else None
            self._on_fleet(FleetView.read(self.coordinator, self.worker_id, self.placement_key, remember))

    # ------------------------------------------------------------------ any thread
    def publish_invalidation(self, adapter_id: str, digest: str, reason: str) -> None:
        """Queue an invalidation for every worker sharing the coordinator (this one included)."""
        with self._outbox_lock:
            self._outbox.append((adapter_id, digest, reason))
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="adapter-coordinator-sync", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread, then drop this worker's heartbeat (bounded: a frozen Redis is left behind)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return  # stuck on the coordinator; the heartbeat expires by itself
            self._thread = None
        done = threading.Thread(target=self.coordinator.release_worker, args=(self.worker_id,), daemon=True)
        done.start()
        done.join(timeout)

    def _run(self) -> None:
        next_flush = 0.0
        while not self._stop.is_set():
            try:
                self.publish_queued()
                self.poll_invalidations()
                if time.monotonic() >= next_flush:
                    next_flush = time.monotonic() + self.interval_s
                    self.check_epoch()
                    self.flush_residency()
                    self.heartbeat()
                    self.share_popularity()
            except Exception:
                log.exception("adapter coordination round failed")
            self._wake.wait(self.poll_s)
            self._wake.clear()
