"""The coordinator interface shared by workers and the store.

Soft state only: each worker's own slot table is the truth and is republished after a
reconnect, and after the coordinator lost its state (a Redis restarted with no persistence, or
flushed: its epoch changed). Invalidation events form an append-only log read from a cursor (a
Redis Stream in the networked implementation), so a reader that was away catches up on what it
missed — unless the log itself was lost with the state: a worker then compares what it holds with
the store's own registry instead (store_check.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

FIRST_EVENT_ID = "0-0"  # read_invalidations(FIRST_EVENT_ID) returns every event still kept


@dataclass(frozen=True)
class InvalidationEvent:
    """An adapter version stopped being current: re-registered (`digest` is the new one) or
    deleted (`digest` empty). `event_id` is an opaque, ordered cursor ("<ms>-<seq>", as Redis
    Stream ids); readers resume after the last one they saw, starting from FIRST_EVENT_ID."""

    event_id: str
    adapter_id: str
    digest: str  # new digest; "" when deleted
    reason: str  # "registered" | "deleted"


@dataclass(frozen=True)
class Residency:
    """Where one worker holds one adapter version."""

    worker_id: str
    adapter_id: str
    digest: str
    tier: str  # "gpu" | "cpu" | "loading"
    slot: int  # -1 when not in a GPU slot
    last_used: int  # value of the cluster LRU clock at last use


@dataclass(frozen=True)
class WorkerHeartbeat:
    worker_id: str
    address: str
    expires_at: float  # monotonic seconds in-process, wall clock in networked implementations
    info: dict[str, float | int | str] = field(default_factory=dict)  # capacity, load


@runtime_checkable
class Coordinator(Protocol):
    # --- the state's life: an id that changes when the state is lost, never while it is kept ---
    def epoch(self) -> str:
        """The epoch; on a change this process's residency and pins are written again (as after
        an outage) before it returns. "" when it cannot be read now (unreachable)."""

    # --- LRU clock: a cluster-wide counter bumped on every adapter use ---
    def tick(self) -> int: ...

    # --- residency: adapter -> tier/slot/last use, per worker ---
    def put_residency(self, residency: Residency) -> None: ...
    def drop_residency(self, worker_id: str, adapter_id: str) -> None: ...
    def residencies(self, worker_id: str | None = None) -> list[Residency]: ...

    # --- heartbeats with a TTL ---
    def heartbeat(
        self, worker_id: str, address: str, ttl_s: float, info: dict[str, float | int | str]
    ) -> None: ...
    def live_workers(self) -> list[WorkerHeartbeat]: ...
    def release_worker(self, worker_id: str) -> None: ...

    # --- pins: adapters a worker must never evict ---
    def set_pin(self, worker_id: str, adapter_id: str, pinned: bool) -> None: ...
    def pins(self, worker_id: str) -> set[str]: ...

    # --- popularity: each worker's decayed request counts per adapter, summed over the fleet ---
    def publish_popularity(self, worker_id: str, counts: dict[str, float], ttl_s: float) -> None: ...
    def fleet_popularity(self) -> dict[str, float]: ...

    # --- invalidation events (append-only, read from a cursor) ---
    def publish_invalidation(self, adapter_id: str, digest: str, reason: str) -> str:
        """The event's id; "" when it was not published (Redis unreachable): the caller retries."""

    def read_invalidations(self, after_id: str = ..., limit: int = 1000) -> list[InvalidationEvent]: ...
