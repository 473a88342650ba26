"""The two tiers an adapter version lives in: GPU slots (the weights in `lora.LoRASlots`, the
bookkeeping in `SlotTable`) and the pinned CPU cache, both least recently used first out; a slot
whose version the CPU cache also holds is recycled before one whose version it does not.

Moves between them (a CPU payload copied into a slot, evictions, versions dropped) keep the
metrics' gauges current and report each adapter whose residency changed to `changed`, which the
residency publisher mirrors to the coordinator later, off the step thread. Not thread-safe: the
adapters' state lock guards it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from loraserve.inference_worker.adapters.cpu_cache import CpuCache
from loraserve.inference_worker.adapters.metrics import AdapterMetrics
from loraserve.inference_worker.adapters.refs import split_key
from loraserve.inference_worker.adapters.slot_table import SlotState, SlotTable
from loraserve.inference_worker.errors import AdapterSlotsExhausted
from loraserve.inference_worker.lora.payload import AdapterPayload
from loraserve.inference_worker.lora.slots import LoRASlots
from loraserve.serving import tracing


class AdapterTiers:
    def __init__(
        self,
        slots: LoRASlots,
        *,
        max_cpu_loras: int,
        max_cpu_bytes: int,
        metrics: AdapterMetrics,
        changed: Callable[[str], None],
    ) -> None:
        if max_cpu_loras < slots.max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({slots.max_loras})")
        self.slots, self.metrics, self._changed = slots, metrics, changed
        self.cpu = CpuCache(max_cpu_loras, max_cpu_bytes)
        self.table = SlotTable(slots.max_loras, backed=self.cpu.__contains__)
        self.clock = 0  # local LRU clock: orders this worker's own slots, no network
        metrics.slots_total.set(slots.max_loras)

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    # ------------------------------------------------------------------ GPU tier
    def activate(self, s: SlotState, payload: AdapterPayload) -> None:
        """Copy a CPU-tier payload into slot `s` (evicting what it held) on the current stream."""
        if not s.free:
            self.metrics.evictions.labels("gpu").inc()
            old = s.adapter_id
            self.table.release_slot(s)
            self._changed(old)
        t0 = time.perf_counter()
        attributes = {"loraserve.adapter.id": payload.adapter_id, "loraserve.adapter.tier": "gpu"}
        with tracing.span("worker.adapter_load", attributes) as span:
            try:
                self.slots.load(s.index, payload)
            except Exception:
                self.slots.clear(s.index)
                self.metrics.loads.labels("gpu", "error").inc()
                raise
            load_ms = (time.perf_counter() - t0) * 1e3
            tracing.annotate({"loraserve.load_ms": load_ms, "loraserve.bytes": payload.nbytes}, span)
        self.table.assign(
            s,
            payload.key,
            payload.adapter_id,
            payload.digest,
            payload.rank,
            payload.nbytes,
            self.tick(),
        )
        self.metrics.observe_load("gpu", payload.adapter_id, time.perf_counter() - t0)
        self._changed(payload.adapter_id)
        self.update_gauges()

    def activate_or_raise(self, s: SlotState, payload: AdapterPayload) -> None:
        try:
            self.activate(s, payload)
        except (RuntimeError, ValueError) as exc:  # e.g. no device memory for staging
            raise AdapterSlotsExhausted(
                f"adapter {payload.key} could not be copied into a GPU slot: {exc}"
            ) from exc

    def drop_slot(self, s: SlotState) -> None:
        adapter_id = s.adapter_id
        self.slots.clear(s.index)
        self.table.release_slot(s)
        self._changed(adapter_id)
        self.update_gauges()

    # ------------------------------------------------------------------ CPU tier
    def put_cpu(self, payload: AdapterPayload, keep: Callable[[str], bool] | None = None) -> None:
        """Insert as most recently used; LRU entries past the budgets leave, those `keep` answers
        True for last."""
        try:
            evicted = self.cpu.put(payload, keep)
        except ValueError as exc:
            raise AdapterSlotsExhausted(str(exc)) from None
        for key in evicted:
            self.metrics.evictions.labels("cpu").inc()
            self._changed(split_key(key)[0])
        self._changed(payload.adapter_id)
        self.update_gauges()

    def evict_cpu(self, key: str) -> bool:
        """Evict one CPU-tier entry (a prefetch replacing it with a more popular adapter)."""
        if not self.cpu.remove(key):
            return False
        self.metrics.evictions.labels("cpu").inc()
        self._changed(split_key(key)[0])
        self.update_gauges()
        return True

    # ------------------------------------------------------------------ both
    def holds(self, key: str) -> bool:
        return self.table.lookup(key) is not None or key in self.cpu

    def drop_versions(self, adapter_id: str, keep: str) -> bool:
        """Drop every version of `adapter_id` but `keep` (a digest, "" = none): at once from the CPU
        tier and from idle slots, and from busy slots once their last sequence ends (they admit
        nothing new meanwhile). True when something was dropped."""
        dropped = False
        for key in self.cpu.keys():
            aid, digest = split_key(key)
            if aid == adapter_id and digest != keep:
                self.cpu.remove(key)
                dropped = True
        for s in self.table.of_adapter(adapter_id):
            if s.digest != keep and not s.stale:
                dropped = True
                if s.running == 0:
                    self.drop_slot(s)
                else:
                    self.table.mark_stale(s)
        if dropped:
            self.metrics.invalidations.inc()
            self._changed(adapter_id)
            self.update_gauges()
        return dropped

    def remove_adapter(self, adapter_id: str) -> bool:
        """Every version out of both tiers (the caller checked nothing uses it); True if any was held."""
        held = False
        for s in self.table.of_adapter(adapter_id):
            self.drop_slot(s)
            held = True
        for key in self.cpu.keys():
            if split_key(key)[0] == adapter_id:
                held = self.cpu.remove(key) or held
        self._changed(adapter_id)
        self.update_gauges()
        return held

    def residency(self, adapter_id: str) -> tuple[str, str, int] | None:
        """(digest, tier, slot) of where this worker holds `adapter_id` now, GPU first; None if nowhere."""
        slots = [s for s in self.table.of_adapter(adapter_id) if not s.stale]
        if slots:
            return slots[0].digest, "gpu", slots[0].index
        keys = [k for k in self.cpu.keys() if split_key(k)[0] == adapter_id]
        return (split_key(keys[-1])[1], "cpu", -1) if keys else None

    def digests(self) -> dict[str, str]:
        """adapter id -> digest of a live version held in either tier."""
        out: dict[str, str] = {}
        for key in self.cpu.keys():
            aid, digest = split_key(key)
            out.setdefault(aid, digest)
        for s in self.table.slots:
            if s.key is not None and not s.stale:
                out.setdefault(s.adapter_id, s.digest)
        return out

    def update_gauges(self) -> None:
        self.metrics.slots_used.set(self.table.num_used)
        self.metrics.slots_pinned.set(self.table.num_pinned)
        self.metrics.cpu_adapters.set(len(self.cpu))
        self.metrics.cpu_bytes.set(self.cpu.nbytes)
