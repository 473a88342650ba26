"""The adapter versions this worker holds, and the one lock that guards them.

The pool composes the tiers (GPU slots, pinned CPU cache), the version book, the single-flight
fetcher, the per-adapter counters and the residency marks. Three kinds of threads use it, and none
of them waits on the network while holding the lock:

- the engine's step thread: `acquire` / `release` (a miss starts a fetch and answers "wait");
- the event loop: fetches (the store's gRPC stream), the admin operations;
- the coordinator sync thread: invalidation events in, residency out (`apply_invalidation`,
  `publisher.flush`), with the coordinator round trips outside the lock.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections import OrderedDict

import torch

from loraserve.inference_worker.adapters.fetcher import AdapterFetcher, AdapterSource
from loraserve.inference_worker.adapters.metrics import AdapterMetrics
from loraserve.inference_worker.adapters.popularity import PopularityCounter
from loraserve.inference_worker.adapters.refs import AdapterRef, split_key
from loraserve.inference_worker.adapters.reporting import (
    AdapterStats,
    cpu_state,
    other_state,
    slot_state,
)
from loraserve.inference_worker.adapters.residency import ResidencyPublisher
from loraserve.inference_worker.adapters.slot_table import NOWHERE, SlotState
from loraserve.inference_worker.adapters.tiers import AdapterTiers
from loraserve.inference_worker.adapters.versions import VersionBook
from loraserve.inference_worker.coordination import Coordinator
from loraserve.inference_worker.engine.adapter_hooks import AdapterState
from loraserve.inference_worker.errors import (
    AdapterInUse,
    AdapterMismatch,
    AdapterSlotsExhausted,
    DependencyUnavailable,
)
from loraserve.inference_worker.lora.payload import AdapterPayload
from loraserve.inference_worker.lora.slots import LoRASlots, SlotLoadError

KEPT_OUT_MAX = 4096  # unloaded adapter ids remembered as kept out of prefetch


class AdapterPool:
    def __init__(
        self,
        slots: LoRASlots,
        source: AdapterSource | None,
        coordinator: Coordinator,
        *,
        max_cpu_loras: int,
        max_cpu_bytes: int,
        worker_id: str = "worker",
        metrics: AdapterMetrics | None = None,
        popularity_half_life_s: float = 300.0,
    ) -> None:
        self.lock = threading.RLock()
        self.slots = slots
        self.metrics = metrics if metrics is not None else AdapterMetrics()
        self.worker_id = worker_id
        self.publisher = ResidencyPublisher(coordinator, worker_id, self.lock, self._residency)
        self.tiers = AdapterTiers(
            slots,
            max_cpu_loras=max_cpu_loras,
            max_cpu_bytes=max_cpu_bytes,
            metrics=self.metrics,
            changed=self.publisher.changed,
        )
        self.versions = VersionBook()
        self.fetcher = AdapterFetcher(source, self, self.lock, self.metrics)
        self._held: dict[int, int] = {}  # sequence key -> slot it holds
        # set by look-ahead each step: adapter id -> position of the first queued request for it,
        # sequence key -> its queue position; what they name is evicted last (or not at all)
        self.wanted: dict[str, int] = {}
        self.queue_pos: dict[int, int] = {}
        self.popularity = PopularityCounter(popularity_half_life_s)
        # adapters an operator unloaded here: popularity prefetch leaves them out until a request
        # for one arrives or it is pinned (oldest forgotten past KEPT_OUT_MAX)
        self.kept_out: OrderedDict[str, None] = OrderedDict()
        self._stats: dict[str, AdapterStats] = {}
        lookups = self.metrics.lookups
        self._lookup_gpu, self._lookup_cpu, self._lookup_miss = (
            lookups.labels(w) for w in ("gpu", "cpu", "miss")
        )

    # ------------------------------------------------------------------ step thread
    def acquire(self, seq_key: int, ref: AdapterRef, new_request: bool = True) -> tuple[int, str] | None:
        """(slot, digest) for a sequence whose adapter is (or now is) in a GPU slot; None to wait
        (a fetch or a free slot is pending). Raises WorkerError when the sequence must fail. The
        hold lasts until `release(seq_key)`; `new_request` False (a preempted sequence coming
        back) leaves the request counter alone."""
        with self.lock:
            if seq_key in self._held:
                held = self.tiers.table.slots[self._held[seq_key]]
                return held.index, held.digest
            self.fetcher.raise_failure(seq_key)
            if self.kept_out:
                self.kept_out.pop(ref.adapter_id, None)  # asked for again: prefetch may hold it
            key = self.versions.resolve(ref)
            if key is not None:
                s = self.tiers.table.lookup(key)
                if s is not None:
                    self._lookup_gpu.inc()
                    return self._hold(seq_key, s, new_request)
                payload = self.tiers.cpu.get(key)
                if payload is not None:
                    victim = self.tiers.table.victim(self.wanted, self.queue_pos.get(seq_key, NOWHERE))
                    if victim is None:
                        return None  # every slot busy, pinned or queued for: wait, keep scanning
                    self._lookup_cpu.inc()
                    self._activate(victim, payload)
                    return self._hold(seq_key, victim, new_request)
            self._lookup_miss.inc()
            self.fetcher.fetch(ref, seq_key)
            return None

    def release(self, seq_key: int, num_tokens: int = 0) -> None:
        """The sequence left the running set (finished, cancelled, failed, preempted)."""
        with self.lock:
            self.fetcher.forget(seq_key)
            slot = self._held.pop(seq_key, None)
            if slot is None:
                return
            s = self.tiers.table.slots[slot]
            s.running = max(0, s.running - 1)
            self._stats_of(s.adapter_id).num_tokens += num_tokens
            if s.stale and s.running == 0:
                self.tiers.drop_slot(s)

    def _hold(self, seq_key: int, s: SlotState, new_request: bool) -> tuple[int, str]:
        s.running += 1
        s.last_tick = self.tiers.tick()
        self.publisher.used(s.adapter_id)
        self._held[seq_key] = s.index
        st = self._stats_of(s.adapter_id)
        st.num_requests += int(new_request)
        st.last_used = time.time()
        return s.index, s.digest

    def _activate(self, s: SlotState, payload: AdapterPayload) -> None:
        self.tiers.activate_or_raise(s, payload)
        self._stats_of(payload.adapter_id).num_gpu_loads += 1

    def _stats_of(self, adapter_id: str) -> AdapterStats:
        return self._stats.setdefault(adapter_id, AdapterStats())

    def _stats_or_zero(self, adapter_id: str) -> AdapterStats:
        return self._stats.get(adapter_id) or AdapterStats()

    # ------------------------------------------------------------------ fetched payloads (Installer)
    def generation(self, adapter_id: str) -> int:
        return self.versions.generation(adapter_id)

    def check(self, payload: AdapterPayload) -> None:
        try:
            self.slots.check(payload)
        except SlotLoadError as exc:
            raise AdapterMismatch(f"adapter {payload.adapter_id!r} does not fit this worker: {exc}") from None

    def install(self, payload: AdapterPayload, generation: int) -> bool:
        """Put a fetched payload in the CPU tier unless an invalidation seen during the fetch
        superseded it (then the fetcher fetches again)."""
        aid = payload.adapter_id
        if not self.versions.accepts(aid, payload.digest, generation):
            return False
        if self.versions.learn(aid, payload.digest):
            self.tiers.drop_versions(aid, keep=payload.digest)
        self.tiers.put_cpu(payload, keep=self._queued_for)
        return True

    def _queued_for(self, key: str) -> bool:
        return split_key(key)[0] in self.wanted

    def arrival_tier(self, ref: AdapterRef) -> str:
        """Where this worker holds `ref` now: "gpu", "cpu", or "store" (it must be fetched)."""
        with self.lock:
            key = self.versions.resolve(ref)
            if key is None:
                return "store"
            if self.tiers.table.lookup(key) is not None:
                return "gpu"
            return "cpu" if key in self.tiers.cpu else "store"

    async def ensure_cpu(self, ref: AdapterRef) -> str:
        """Fetch into the CPU tier unless a tier already holds the version; its version key (an
        operator's LoadAdapter: the adapter is no longer kept out of prefetch)."""
        with self.lock:
            self.kept_out.pop(ref.adapter_id, None)
            key = self.versions.resolve(ref)
            if key is not None and self.tiers.holds(key):
                return key
            flight = self.fetcher.fetch(ref, awaited=True)
        assert flight.future is not None
        # shielded: this caller giving up (a cancelled LoadAdapter, a preload's timeout) must not
        # cancel the flight, which requests queued for the adapter wait for too
        got = await asyncio.shield(asyncio.wrap_future(flight.future))
        if isinstance(got, str):
            return got
        raise copy.copy(got)  # the flight's error, shared: raised, a copy carries this call's frames

    # ------------------------------------------------------------------ invalidation
    def apply_invalidation(self, adapter_id: str, digest: str) -> None:
        """The store now serves `digest` for `adapter_id` ("" = deleted): drop every other version.
        A pinned adapter stays resident across re-registration: its new version is brought in."""
        with self.lock:
            self.versions.invalidate(adapter_id, digest)
            self.tiers.drop_versions(adapter_id, keep=digest)
            reload = bool(digest) and adapter_id in self.tiers.table.pins and self.fetcher.source is not None
        if reload:
            self.fetcher.run_on_loop(self._reload_pinned(AdapterRef(adapter_id)))

    async def _reload_pinned(self, ref: AdapterRef) -> None:
        try:
            key = await self.ensure_cpu(ref)
            await asyncio.to_thread(self.activate_now, key)
        except Exception:
            pass

    def known_digests(self) -> dict[str, str]:
        """adapter id -> digest of every version this worker holds or believes current."""
        with self.lock:
            return {**self.tiers.digests(), **self.versions.snapshot()}

    def _residency(self, adapter_id: str) -> tuple[str, str, int] | None:
        return self.tiers.residency(adapter_id)

    # ------------------------------------------------------------------ admin (any thread but the step loop)
    def activate_now(self, key: str, evict: bool = True) -> SlotState | None:
        """Put a CPU-tier version into a GPU slot now (admin path); its slot. `evict` False: only
        into a free slot (None when none is free)."""
        with self.lock:
            s = self.tiers.table.lookup(key)
            if s is not None:
                return s
            payload = self.tiers.cpu.get(key)
            if payload is None:
                raise DependencyUnavailable(
                    f"adapter {key} left the CPU cache before it reached a slot; retry"
                )
            victim = self.tiers.table.victim(self.wanted) if evict else self.tiers.table.free_slot()
            if victim is None and not evict:
                return None
            if victim is None:
                raise AdapterSlotsExhausted(
                    "no GPU slot can be freed: every slot is pinned, used by running sequences or "
                    "held for queued requests"
                )
            cuda = self.slots.device.type == "cuda"
            if cuda:  # the step thread may still be reading the victim's old weights
                torch.cuda.synchronize(self.slots.device)
            self._activate(victim, payload)
            if cuda:
                torch.cuda.synchronize(self.slots.device)
            return victim

    def check_pin_room(self, adapter_id: str) -> None:
        table = self.tiers.table
        if adapter_id not in table.pins and len(table.pins) >= table.max_pins:
            raise AdapterSlotsExhausted(
                f"at most {table.max_pins} adapters can be pinned (max_loras - 1); "
                f"unpin one of {sorted(table.pins)} first"
            )

    def set_pin(self, adapter_id: str, key: str | None) -> None:
        """Pin `adapter_id` with version `key` put in a slot now; `key` None unpins."""
        with self.lock:
            if key is None:
                self.tiers.table.pins.discard(adapter_id)
            else:
                self.check_pin_room(adapter_id)
                self.activate_now(key)
                self.tiers.table.pins.add(adapter_id)
                self.kept_out.pop(adapter_id, None)
            self.publisher.pinned(adapter_id, key is not None)
            self.tiers.update_gauges()

    def unload(self, adapter_id: str) -> bool:
        """Drop every version of `adapter_id` from both tiers (AdapterInUse while pinned or
        running); -> whether one was held. Popularity prefetch then leaves it out until a request
        for it arrives here or it is pinned: an operator's unload is not undone a round later."""
        with self.lock:
            if adapter_id in self.tiers.table.pins:
                raise AdapterInUse(f"adapter {adapter_id!r} is pinned; unpin it first")
            busy = sum(s.running for s in self.tiers.table.of_adapter(adapter_id))
            if busy:
                raise AdapterInUse(f"adapter {adapter_id!r} is in use by {busy} running sequences")
            self.kept_out[adapter_id] = None
            self.kept_out.move_to_end(adapter_id)
            while len(self.kept_out) > KEPT_OUT_MAX:
                self.kept_out.popitem(last=False)
            return self.tiers.remove_adapter(adapter_id)

    # ------------------------------------------------------------------ reporting
    def list(self) -> list[AdapterState]:
        """Every version held or loading: GPU slots first (by slot), then the CPU tier (most
        recently used first), then fetches in flight."""
        with self.lock:
            table, pins = self.tiers.table, self.tiers.table.pins
            out = [self._slot_state(s) for s in table.slots if s.key is not None]
            seen = {s.key for s in table.slots if s.key is not None}
            for key in reversed(self.tiers.cpu.keys()):
                if key not in seen:
                    out.append(self.state(key))
            for ref in self.fetcher.flights:
                aid = ref.adapter_id
                out.append(other_state(aid, ref.digest, "loading", self._stats_or_zero(aid), aid in pins))
            return out

    def state(self, key: str) -> AdapterState:
        with self.lock:
            s = self.tiers.table.lookup(key)
            if s is not None:
                return self._slot_state(s)
            aid, digest = split_key(key)
            pinned = aid in self.tiers.table.pins
            payload = self.tiers.cpu.peek(key)
            if payload is not None:
                return cpu_state(payload, self._stats_or_zero(aid), pinned)
            return other_state(aid, digest, "", self._stats_or_zero(aid), pinned)

    def state_of(self, ref: AdapterRef) -> AdapterState:
        with self.lock:
            key = self.versions.resolve(ref)
            return self.state(key or f"{ref.adapter_id}@{ref.digest}")

    def _slot_state(self, s: SlotState) -> AdapterState:
        return slot_state(s, self._stats_or_zero(s.adapter_id), self.tiers.table.is_pinned(s))
