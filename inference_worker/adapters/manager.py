"""The adapter manager: two LRU tiers (GPU slots, pinned CPU cache), single-flight fetches from
the store, pins, invalidation, and the per-adapter counters that ListAdapters reports.

Threads: the engine's step thread calls `acquire`/`release` (never blocking on the network: a
miss starts a fetch on the asyncio loop and answers "wait"); the loop runs fetches and the admin
operations. One lock guards all state; a second one serialises invalidation reads, so the
coordinator round trip happens outside the state lock.

Versions are keys "id@digest". `current[id]` is the digest the worker believes the store serves;
a request for a plain id uses it, a request for "id@digest" needs exactly that version. A version
superseded at the store (new digest seen in a fetch or an invalidation event) is dropped from the
CPU tier at once and from its GPU slot as soon as no running sequence uses it; it admits nothing
new in the meantime, so nothing stale is served once the worker knows.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from clients.adapter_layout import ADAPTER_ID_RE
from inference_worker.adapters.cpu_cache import CpuCache
from inference_worker.adapters.metrics import AdapterMetrics
from inference_worker.adapters.slot_table import SlotState, SlotTable
from inference_worker.coordination import FIRST_EVENT_ID, Coordinator, InProcessCoordinator, Residency
from inference_worker.engine.adapter_hooks import AdapterState
from inference_worker.errors import (
    AdapterInUse,
    AdapterMismatch,
    AdapterSlotsExhausted,
    DependencyUnavailable,
    InvalidRequest,
    NoAdapterStore,
    WorkerError,
)
from inference_worker.lora.payload import AdapterPayload
from inference_worker.lora.slots import LoRASlots, SlotLoadError

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
MAX_STALE_RETRIES = 3
MAX_FAILED_KEPT = 4096
POLL_EVERY_S = 0.02  # admission reads invalidation events at most this often


class AdapterSource(Protocol):
    async def fetch(self, adapter_id: str, digest: str = "") -> AdapterPayload: ...


def parse_ref(ref: str) -> tuple[str, str]:
    """ "id" or "id@digest" -> (id, digest or "")."""
    adapter_id, _, digest = ref.partition("@")
    if not ADAPTER_ID_RE.match(adapter_id):
        raise InvalidRequest(f"adapter id {adapter_id!r} must match {ADAPTER_ID_RE.pattern}")
    if "@" in ref and not _DIGEST.match(digest):
        raise InvalidRequest(f"adapter digest {digest!r} must be 64 lowercase hex characters (sha256)")
    return adapter_id, digest


@dataclass
class AdapterStats:
    num_requests: int = 0
    num_tokens: int = 0
    num_gpu_loads: int = 0
    last_used: float = 0.0  # wall-clock seconds, 0 = never


@dataclass
class _Flight:
    adapter_id: str
    digest: str
    waiters: set[int] = field(default_factory=set)  # sequence keys
    future: concurrent.futures.Future | None = None  # -> key "id@digest"


class AdapterManager:
    def __init__(self, slots: LoRASlots, source: AdapterSource | None, *, max_cpu_loras: int,
                 max_cpu_bytes: int, coordinator: Coordinator | None = None, worker_id: str = "worker",
                 metrics: AdapterMetrics | None = None) -> None:
        if max_cpu_loras < slots.max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({slots.max_loras})")
        self.slots, self.source = slots, source
        self.table = SlotTable(slots.max_loras)
        self.cpu = CpuCache(max_cpu_loras, max_cpu_bytes)
        self.coordinator: Coordinator = coordinator if coordinator is not None else InProcessCoordinator()
        self.worker_id = worker_id
        self.metrics = metrics if metrics is not None else AdapterMetrics()
        self.metrics.slots_total.set(slots.max_loras)
        self._lookup_gpu, self._lookup_cpu, self._lookup_miss = (self.metrics.lookups.labels(where)
                                                                 for where in ("gpu", "cpu", "miss"))
        self._lock = threading.RLock()
        self._cursor_lock = threading.Lock()  # guards _event_cursor; taken before _lock, never under it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._current: dict[str, str] = {}  # adapter id -> digest believed current at the store
        self._generation: dict[str, int] = {}  # adapter id -> invalidations seen
        self._flights: dict[str, _Flight] = {}  # "id" or "id@digest" -> fetch in progress
        self._held: dict[int, int] = {}  # sequence key -> slot it holds
        self._failed: dict[int, WorkerError] = {}  # sequence key -> why its adapter cannot load
        self._stats: dict[str, AdapterStats] = {}
        self._event_cursor = FIRST_EVENT_ID
        self._clock = 0  # local LRU clock
        self._dirty: set[str] = set()  # adapter ids whose residency changed since the last flush
        self._used: set[str] = set()  # adapter ids used since the last flush
        self._cluster_last_used: dict[str, int] = {}
        self._last_poll = 0.0
        self._listeners: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ wiring
    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop fetches run on (the gRPC server's)."""
        self._loop = loop

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Called (from any thread) whenever a fetch ends, so a waiting engine re-scans its queue."""
        self._listeners.append(callback)

    def _notify(self) -> None:
        for cb in list(self._listeners):
            cb()

    # ------------------------------------------------------------------ step thread
    def acquire(self, seq_key: int, ref: str, new_request: bool = True) -> tuple[int, str] | None:
        """(slot, digest) for a sequence whose adapter is (or now is) in a GPU slot; None to wait
        (a fetch or a free slot is pending). Raises WorkerError when the sequence must fail.
        Holding the slot lasts until `release(seq_key)`. `new_request` False (a preempted
        sequence coming back) leaves the request counter alone."""
        now = time.monotonic()
        if now - self._last_poll >= POLL_EVERY_S:  # the coordinator may be a network hop away
            self._last_poll = now
            self.poll_invalidations()
        with self._lock:
            if seq_key in self._held:
                held = self.table.slots[self._held[seq_key]]
                return held.index, held.digest
            failed = self._failed.pop(seq_key, None)
            if failed is not None:
                raise failed
            adapter_id, digest = parse_ref(ref)
            key = self._resolve(adapter_id, digest)
            if key is not None:
                s = self.table.lookup(key)
                if s is not None:
                    self._lookup_gpu.inc()
                    return self._hold(seq_key, s, new_request)
                payload = self.cpu.get(key)
                if payload is not None:
                    victim = self.table.victim()
                    if victim is None:
                        return None  # every slot busy or pinned: wait, keep scanning others
                    self._lookup_cpu.inc()
                    try:
                        self._activate(victim, payload)
                    except (RuntimeError, ValueError) as exc:  # e.g. no device memory for staging
                        raise AdapterSlotsExhausted(f"adapter {key} could not be copied into a GPU slot: {exc}") from exc
                    return self._hold(seq_key, victim, new_request)
            self._lookup_miss.inc()
            self._start_flight(adapter_id, digest, seq_key)
            return None

    def release(self, seq_key: int, num_tokens: int = 0) -> None:
        """The sequence finished (or was cancelled / failed): drop its hold, count its tokens."""
        with self._lock:
            self._failed.pop(seq_key, None)
            for f in self._flights.values():
                f.waiters.discard(seq_key)
            slot = self._held.pop(seq_key, None)
            if slot is None:
                return
            s = self.table.slots[slot]
            s.running = max(0, s.running - 1)
            self._stats.setdefault(s.adapter_id, AdapterStats()).num_tokens += num_tokens
            if s.stale and s.running == 0:
                self._drop_slot(s)

    def _hold(self, seq_key: int, s: SlotState, new_request: bool) -> tuple[int, str]:
        s.running += 1
        s.last_tick = self._next_tick()
        self._used.add(s.adapter_id)
        self._held[seq_key] = s.index
        st = self._stats.setdefault(s.adapter_id, AdapterStats())
        st.num_requests += int(new_request)
        st.last_used = time.time()
        self._publish(s.adapter_id)
        return s.index, s.digest

    def _resolve(self, adapter_id: str, digest: str) -> str | None:
        if digest:
            return f"{adapter_id}@{digest}"
        cur = self._current.get(adapter_id)
        return f"{adapter_id}@{cur}" if cur else None

    def _activate(self, s: SlotState, payload: AdapterPayload) -> None:
        """Copy a CPU-tier payload into slot `s` (evicting what it held) on the current stream."""
        if not s.free:
            self.metrics.evictions.labels("gpu").inc()
            old = s.adapter_id
            self.table.release_slot(s)
            self._publish(old)
        t0 = time.perf_counter()
        try:
            self.slots.load(s.index, payload)
        except Exception:
            self.slots.clear(s.index)
            self.metrics.loads.labels("gpu", "error").inc()
            raise
        self.table.assign(s, payload.key, payload.adapter_id, payload.digest, payload.rank, payload.nbytes,
                          self._next_tick())
        self.metrics.load_seconds.labels("gpu").observe(time.perf_counter() - t0)
        self.metrics.loads.labels("gpu", "ok").inc()
        self._stats.setdefault(payload.adapter_id, AdapterStats()).num_gpu_loads += 1
        self._publish(payload.adapter_id)
        self._update_gauges()

    def _drop_slot(self, s: SlotState) -> None:
        adapter_id = s.adapter_id
        self.slots.clear(s.index)
        self.table.release_slot(s)
        self._publish(adapter_id)
        self._update_gauges()

    # ------------------------------------------------------------------ fetches
    def _start_flight(self, adapter_id: str, digest: str, waiter: int | None) -> _Flight:
        fkey = f"{adapter_id}@{digest}" if digest else adapter_id
        flight = self._flights.get(fkey)
        if flight is None:
            if self.source is None:
                raise NoAdapterStore()
            if self._loop is None or self._loop.is_closed():
                raise DependencyUnavailable("the adapter manager is not running (no event loop bound)")
            flight = _Flight(adapter_id, digest)
            self._flights[fkey] = flight
            flight.future = asyncio.run_coroutine_threadsafe(self._fly(fkey, flight), self._loop)
        if waiter is not None:
            flight.waiters.add(waiter)
        return flight

    async def _fly(self, fkey: str, flight: _Flight) -> str:
        assert self.source is not None
        t0 = time.perf_counter()
        try:
            for _ in range(MAX_STALE_RETRIES):
                with self._lock:
                    generation = self._generation.get(flight.adapter_id, 0)
                payload = await self.source.fetch(flight.adapter_id, flight.digest)
                try:
                    self.slots.check(payload)
                except SlotLoadError as exc:
                    raise AdapterMismatch(f"adapter {payload.adapter_id!r} does not fit this worker: {exc}") from None
                with self._lock:
                    if self._install(payload, generation):
                        self.metrics.loads.labels("cpu", "ok").inc()
                        self.metrics.load_seconds.labels("cpu").observe(time.perf_counter() - t0)
                        return payload.key
            raise DependencyUnavailable(f"adapter {flight.adapter_id!r} kept changing at the store while fetching")
        except Exception as exc:
            err = exc if isinstance(exc, WorkerError) else DependencyUnavailable(
                f"fetching adapter {flight.adapter_id!r} failed: {type(exc).__name__}: {exc}")
            self.metrics.loads.labels("cpu", err.code.lower()).inc()
            with self._lock:
                for seq_key in flight.waiters:
                    self._failed[seq_key] = err
                # a sequence cancelled while waiting never comes back for its failure: keep few
                for seq_key in list(self._failed)[: max(0, len(self._failed) - MAX_FAILED_KEPT)]:
                    del self._failed[seq_key]
            raise err from None
        finally:
            with self._lock:
                if self._flights.get(fkey) is flight:
                    del self._flights[fkey]
            self._notify()

    def _install(self, payload: AdapterPayload, generation: int) -> bool:
        """Put a fetched payload in the CPU tier unless an invalidation seen during the fetch
        superseded it (then the caller fetches again)."""
        aid = payload.adapter_id
        if self._generation.get(aid, 0) != generation and self._current.get(aid, "") != payload.digest:
            return False
        if self._current.get(aid) != payload.digest:
            self._current[aid] = payload.digest
            self._drop_versions(aid, keep=payload.digest)
        try:
            evicted = self.cpu.put(payload)
        except ValueError as exc:
            raise AdapterSlotsExhausted(str(exc)) from None
        for key in evicted:
            self.metrics.evictions.labels("cpu").inc()
            self._publish(key.partition("@")[0])
        self._publish(aid)
        self._update_gauges()
        return True

    def add_payload(self, payload: AdapterPayload) -> str:
        """Put a payload obtained elsewhere (a warm start, benchmarks) into the CPU tier; its key."""
        try:
            self.slots.check(payload)
        except SlotLoadError as exc:
            raise AdapterMismatch(f"adapter {payload.adapter_id!r} does not fit this worker: {exc}") from None
        with self._lock:
            self._install(payload, self._generation.get(payload.adapter_id, 0))
        return payload.key

    async def ensure_cpu(self, ref: str) -> str:
        """Fetch into the CPU tier unless a tier already holds the version; returns its key."""
        adapter_id, digest = parse_ref(ref)
        with self._lock:
            key = self._resolve(adapter_id, digest)
            if key is not None and (self.table.lookup(key) is not None or key in self.cpu):
                return key
            flight = self._start_flight(adapter_id, digest, None)
        assert flight.future is not None
        return await asyncio.wrap_future(flight.future)

    # ------------------------------------------------------------------ invalidation
    def invalidate(self, adapter_id: str, digest: str) -> None:
        """The store now serves `digest` for `adapter_id` ("" = deleted): drop every other version."""
        with self._lock:
            self._generation[adapter_id] = self._generation.get(adapter_id, 0) + 1
            if digest:
                self._current[adapter_id] = digest
            else:
                self._current.pop(adapter_id, None)
            self._drop_versions(adapter_id, keep=digest)
            reload = bool(digest) and adapter_id in self.table.pins and self.source is not None
        if reload and self._loop is not None and not self._loop.is_closed():
            # a pinned adapter stays resident across re-registration: bring in the new version
            asyncio.run_coroutine_threadsafe(self._reload_pinned(adapter_id), self._loop)

    async def _reload_pinned(self, adapter_id: str) -> None:
        try:
            await self.load(adapter_id, "gpu")
        except WorkerError:
            pass  # the next request retries (and reports) the load

    def _drop_versions(self, adapter_id: str, keep: str) -> None:
        dropped = False
        for key in self.cpu.keys():
            aid, _, dg = key.partition("@")
            if aid == adapter_id and dg != keep:
                self.cpu.remove(key)
                dropped = True
        for s in self.table.of_adapter(adapter_id):
            if s.digest != keep and not s.stale:
                dropped = True
                if s.running == 0:
                    self._drop_slot(s)
                else:
                    self.table.mark_stale(s)
        if dropped:
            self.metrics.invalidations.inc()
            self._publish(adapter_id)
            self._update_gauges()

    def poll_invalidations(self) -> int:
        """Apply invalidation events published since the last poll; returns how many."""
        with self._cursor_lock:
            events = self.coordinator.read_invalidations(self._event_cursor)
            if events:
                with self._lock:
                    for e in events:
                        self.invalidate(e.adapter_id, e.digest)
                        self._event_cursor = e.event_id
            return len(events)

    def known_digests(self) -> dict[str, str]:
        """adapter id -> digest of every version this worker holds or believes current."""
        with self._lock:
            out = dict(self._current)
            for key in self.cpu.keys():
                aid, _, dg = key.partition("@")
                out.setdefault(aid, dg)
            for s in self.table.slots:
                if s.key is not None and not s.stale:
                    out.setdefault(s.adapter_id, s.digest)
            return out

    # ------------------------------------------------------------------ admin
    async def load(self, ref: str, tier: str = "gpu") -> AdapterState:
        key = await self.ensure_cpu(ref)
        if tier == "gpu":
            await asyncio.to_thread(self._activate_now, key)
        return self.status(key)

    def activate(self, key: str) -> int:
        """Put a CPU-tier version into a GPU slot now (admin path, any thread but the step
        thread's hot loop); returns the slot."""
        return self._activate_now(key).index

    def _activate_now(self, key: str) -> SlotState:
        with self._lock:
            s = self.table.lookup(key)
            if s is not None:
                return s
            payload = self.cpu.get(key)
            if payload is None:
                raise DependencyUnavailable(f"adapter {key} left the CPU cache before it reached a slot; retry")
            victim = self.table.victim()
            if victim is None:
                raise AdapterSlotsExhausted("no GPU slot can be freed: every slot is pinned or used by running sequences")
            cuda = self.slots.device.type == "cuda"
            if cuda:  # the step thread may still be reading the victim's old weights
                torch.cuda.synchronize(self.slots.device)
            self._activate(victim, payload)
            if cuda:
                torch.cuda.synchronize(self.slots.device)
            return victim

    async def pin(self, ref: str, pinned: bool) -> AdapterState:
        adapter_id, _ = parse_ref(ref)
        if not pinned:
            with self._lock:
                self.table.pins.discard(adapter_id)
                self.coordinator.set_pin(self.worker_id, adapter_id, False)
                self._update_gauges()
            return self.status_by_id(adapter_id)
        with self._lock:
            self._check_pin_room(adapter_id)
        key = await self.ensure_cpu(ref)
        await asyncio.to_thread(self._pin_now, key, adapter_id)
        return self.status(key)

    def _pin_now(self, key: str, adapter_id: str) -> None:
        with self._lock:
            self._check_pin_room(adapter_id)
            self._activate_now(key)
            self.table.pins.add(adapter_id)
            self.coordinator.set_pin(self.worker_id, adapter_id, True)
            self._update_gauges()

    def _check_pin_room(self, adapter_id: str) -> None:
        if adapter_id not in self.table.pins and len(self.table.pins) >= self.table.max_pins:
            raise AdapterSlotsExhausted(f"at most {self.table.max_pins} adapters can be pinned (max_loras - 1); "
                                  f"unpin one of {sorted(self.table.pins)} first")

    async def unload(self, ref: str) -> bool:
        adapter_id, _ = parse_ref(ref)
        with self._lock:
            if adapter_id in self.table.pins:
                raise AdapterInUse(f"adapter {adapter_id!r} is pinned; unpin it first")
            busy = sum(s.running for s in self.table.of_adapter(adapter_id))
            if busy:
                raise AdapterInUse(f"adapter {adapter_id!r} is in use by {busy} running sequences")
            held = False
            for s in self.table.of_adapter(adapter_id):
                self._drop_slot(s)
                held = True
            for key in self.cpu.keys():
                if key.partition("@")[0] == adapter_id:
                    held = self.cpu.remove(key) or held
            self._publish(adapter_id)
            self._update_gauges()
            return held

    # ------------------------------------------------------------------ reporting
    def list(self) -> list[AdapterState]:
        """Every version held or loading: GPU slots first (by slot), then the CPU tier (most
        recently used first), then fetches in flight."""
        with self._lock:
            out = [self._status_of_slot(s) for s in self.table.slots if s.key is not None]
            seen = {s.key for s in self.table.slots if s.key is not None}
            for key in reversed(self.cpu.keys()):
                if key not in seen:
                    out.append(self._status_of_cpu(key))
            for f in self._flights.values():
                st = self._stats.get(f.adapter_id, AdapterStats())
                out.append(AdapterState(f.adapter_id, f.digest, "loading", -1, f.adapter_id in self.table.pins,
                                         st.last_used or None, 0, 0, st.num_requests, st.num_tokens, st.num_gpu_loads, 0))
            return out

    def status(self, key: str) -> AdapterState:
        with self._lock:
            s = self.table.lookup(key)
            if s is not None:
                return self._status_of_slot(s)
            if key in self.cpu:
                return self._status_of_cpu(key)
            aid, _, dg = key.partition("@")
            st = self._stats.get(aid, AdapterStats())
            return AdapterState(aid, dg, "", -1, aid in self.table.pins, st.last_used or None, 0, 0,
                                 st.num_requests, st.num_tokens, st.num_gpu_loads, 0)

    def status_by_id(self, adapter_id: str) -> AdapterState:
        with self._lock:
            key = self._resolve(adapter_id, "") or f"{adapter_id}@"
            return self.status(key)

    def _status_of_slot(self, s: SlotState) -> AdapterState:
        st = self._stats.get(s.adapter_id, AdapterStats())
        return AdapterState(s.adapter_id, s.digest, "gpu", s.index, self.table.is_pinned(s), st.last_used or None,
                             s.rank, s.size_bytes, st.num_requests, st.num_tokens, st.num_gpu_loads, s.running)

    def _status_of_cpu(self, key: str) -> AdapterState:
        p = self.cpu.peek(key)
        assert p is not None
        st = self._stats.get(p.adapter_id, AdapterStats())
        return AdapterState(p.adapter_id, p.digest, "cpu", -1, p.adapter_id in self.table.pins, st.last_used or None,
                             p.rank, p.nbytes, st.num_requests, st.num_tokens, st.num_gpu_loads, 0)

    def _next_tick(self) -> int:
        """This worker's LRU clock (orders its own slots; no network on the step thread)."""
        self._clock += 1
        return self._clock

    def _publish(self, adapter_id: str) -> None:
        """Mark `adapter_id`'s residency for the next `flush_residency`."""
        self._dirty.add(adapter_id)

    def flush_residency(self) -> int:
        """Mirror the residency of adapters that changed since the last flush to the coordinator,
        adapters used since then stamped with one tick of the cluster-wide LRU clock. Called off
        the step thread (the watcher), so admission never waits on the coordinator."""
        with self._lock:
            dirty, used = self._dirty | self._used, self._used
            self._dirty, self._used = set(), set()
            entries: list[tuple[str, str, str, int]] = []  # (id, digest, tier, slot); tier "" = gone
            for adapter_id in sorted(dirty):
                slots = [s for s in self.table.of_adapter(adapter_id) if not s.stale]
                keys = [k for k in self.cpu.keys() if k.partition("@")[0] == adapter_id]
                if slots:
                    entries.append((adapter_id, slots[0].digest, "gpu", slots[0].index))
                elif keys:
                    entries.append((adapter_id, keys[-1].partition("@")[2], "cpu", -1))
                else:
                    entries.append((adapter_id, "", "", -1))
        if not entries:
            return 0
        tick = self.coordinator.tick() if used else 0
        for adapter_id, digest, tier, slot in entries:
            if not tier:
                self._cluster_last_used.pop(adapter_id, None)
                self.coordinator.drop_residency(self.worker_id, adapter_id)
                continue
            if adapter_id in used:
                self._cluster_last_used[adapter_id] = tick
            last = self._cluster_last_used.get(adapter_id, 0)
            self.coordinator.put_residency(Residency(self.worker_id, adapter_id, digest, tier, slot, last))
        return len(entries)

    def _update_gauges(self) -> None:
        self.metrics.slots_used.set(self.table.num_used)
        self.metrics.slots_pinned.set(self.table.num_pinned)
        self.metrics.cpu_adapters.set(len(self.cpu))
        self.metrics.cpu_bytes.set(self.cpu.nbytes)
