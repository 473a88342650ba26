"""The GPU tier's bookkeeping: which adapter version each slot holds, how many running
sequences use it, when it was last used (cluster LRU clock), and which adapters are pinned.
The weights themselves live in lora/slots.py.

Which idle slot a new version takes: least recently used first, among those whose version the
CPU tier also holds (`backed`) before those whose version this worker holds nowhere else. A
backed slot recycled loses nothing (the next request copies the version back from the CPU tier,
~1 ms); an unbacked one loses the adapter to the store (tens of ms). The CPU tier evicts by its own
order, which a slot's hits do not touch, so the slots come to hold adapters the tier does not,
and the two tiers together hold more distinct adapters (`test_fleet_simulation.py`)."""

from __future__ import annotations

import heapq
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

NOWHERE = sys.maxsize  # queue position of a request that is not queued


@dataclass
class SlotState:
    index: int
    key: str | None = None  # "id@digest"; None = free
    adapter_id: str = ""
    digest: str = ""
    rank: int = 0
    size_bytes: int = 0
    running: int = 0  # sequences admitted with this slot and not finished
    last_tick: int = 0  # LRU clock value at last use
    stale: bool = False  # superseded at the store: admits nothing new, freed when running hits 0

    @property
    def free(self) -> bool:
        return self.key is None


class SlotTable:
    def __init__(self, num_slots: int, backed: Callable[[str], bool] | None = None) -> None:
        """`backed(key)`: whether the CPU tier holds that version too (default: never)."""
        self.slots = [SlotState(i) for i in range(num_slots)]
        self.backed = backed or (lambda key: False)
        self.by_key: dict[str, int] = {}  # live (non-stale) versions only
        self.pins: set[str] = set()  # adapter ids
        # kept as slots fill and empty, so no question below scans every slot (a worker may have
        # a slot for each of a thousand adapters): free indices (a heap, lowest first; an index
        # that was filled since it was pushed is dropped when met) and each adapter's slots
        self._free = list(range(num_slots))
        self._num_used = 0
        self._by_adapter: dict[str, set[int]] = {}

    @property
    def max_pins(self) -> int:
        """At most max_loras - 1 pinned, so one slot always rotates for everything else."""
        return len(self.slots) - 1

    def lookup(self, key: str) -> SlotState | None:
        i = self.by_key.get(key)
        return None if i is None else self.slots[i]

    def is_pinned(self, s: SlotState) -> bool:
        return not s.stale and s.adapter_id in self.pins

    def victim(self, wanted: Mapping[str, int] | None = None, before: int = NOWHERE) -> SlotState | None:
        """A free slot, else the least recently used one that no running sequence uses and that is
        not pinned, those whose version the CPU tier also holds first; None when every slot is busy
        or pinned. `wanted` (adapter id -> position of the first queued request for it) keeps the
        adapters of requests queued ahead of position `before` out of reach, and spares those
        queued behind it while any other slot is idle."""
        free = self.free_slot()
        if free is not None:
            return free
        queued = wanted or {}
        idle = [
            s
            for s in self.slots
            if s.running == 0 and not self.is_pinned(s) and queued.get(s.adapter_id, NOWHERE) >= before
        ]
        if not idle:
            return None
        backed = self.backed
        return min(idle, key=lambda s: (s.adapter_id in queued, not backed(s.key or ""), s.last_tick))

    def free_slot(self) -> SlotState | None:
        """The lowest-numbered slot that holds nothing (filling it evicts nothing)."""
        heap = self._free
        while heap and not self.slots[heap[0]].free:
            heapq.heappop(heap)
        return self.slots[heap[0]] if heap else None

    def assign(
        self, s: SlotState, key: str, adapter_id: str, digest: str, rank: int, size_bytes: int, tick: int
    ) -> None:
        self._clear(s)
        s.key, s.adapter_id, s.digest, s.rank, s.size_bytes = key, adapter_id, digest, rank, size_bytes
        s.running, s.last_tick, s.stale = 0, tick, False
        self.by_key[key] = s.index
        self._num_used += 1
        self._by_adapter.setdefault(adapter_id, set()).add(s.index)

    def release_slot(self, s: SlotState) -> None:
        if not self._clear(s):
            return
        heap = self._free
        heapq.heappush(heap, s.index)
        if len(heap) > 4 * len(self.slots):  # entries of slots filled since: start the heap afresh
            heap[:] = [x.index for x in self.slots if x.free]
            heapq.heapify(heap)

    def _clear(self, s: SlotState) -> bool:
        """Empties `s`; whether it held a version."""
        key = s.key
        if key is not None:
            if self.by_key.get(key) == s.index:
                del self.by_key[key]
            same = self._by_adapter[s.adapter_id]
            same.discard(s.index)
            if not same:
                del self._by_adapter[s.adapter_id]
            self._num_used -= 1
        s.key, s.adapter_id, s.digest, s.rank, s.size_bytes = None, "", "", 0, 0
        s.running, s.stale = 0, False
        return key is not None

    def mark_stale(self, s: SlotState) -> None:
        if s.key is not None and self.by_key.get(s.key) == s.index:
            del self.by_key[s.key]
        s.stale = True

    def of_adapter(self, adapter_id: str) -> list[SlotState]:
        return [self.slots[i] for i in sorted(self._by_adapter.get(adapter_id, ()))]

    @property
    def num_used(self) -> int:
        return self._num_used

    @property
    def num_pinned(self) -> int:
        return sum(1 for aid in self.pins for s in self.of_adapter(aid) if not s.stale)
