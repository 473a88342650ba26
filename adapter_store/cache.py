"""The CPU cache of optimized adapters: LRU, bounded by a count and by bytes.

An adapter larger than the byte budget is never cached (it is rebuilt from its source per fetch).
Entries carry their digest, so a re-registered adapter never serves a stale payload, and the
registry record they were last served under, so cached adapters keep streaming while the registry
is unreachable.

A put says when its record was read from the registry: `generation()`, taken before the read. It is
refused when the adapter was dropped (deleted) or put again (registered anew, or put from a later
read) since then, so a fetch or registration that read a record before a delete or a re-registration
never puts that record's payload back after it. A registration's put (`registered`), whose record is
the registry's newest, is refused only by a drop or another registration since: a fetch's put meanwhile
may be of the record it replaced, read before its write.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from loraserve.adapter_store.change_clock import ChangeClock
from loraserve.adapter_store.optimize import OptimizedAdapter
from loraserve.adapter_store.registry import AdapterRecord

# adapter ids whose last drop or put is remembered; a put read before the oldest forgotten change
# is refused whatever its id (a cache miss later, never a stale payload)
MAX_CHANGES = 16_384
PUT, REGISTERED = 0, 1  # the clock's kinds: a put or drop; a drop or registration


class AdapterCache:
    def __init__(
        self,
        max_adapters: int,
        max_bytes: int,
        on_evict: Callable[[str, OptimizedAdapter], None] | None = None,
    ) -> None:
        self.max_adapters, self.max_bytes = max_adapters, max_bytes
        # adapter id -> (last known record, payload), least recently used first
        self._entries: OrderedDict[str, tuple[AdapterRecord, OptimizedAdapter]] = OrderedDict()
        self._bytes = 0
        self._changes = ChangeClock(2, MAX_CHANGES)  # adapter id -> (put or drop, drop or registration)
        self._lock = threading.Lock()
        self._on_evict = on_evict

    def generation(self) -> int:
        """The clock now: take it before reading the registry record whose payload is put later."""
        with self._lock:
            return self._changes.now

    def get(
        self, adapter_id: str, digest: str, record: AdapterRecord | None = None
    ) -> OptimizedAdapter | None:
        """The cached payload of that digest (an entry of another digest is dropped); on a hit, record
        (the registry's current one) becomes the entry's last known record."""
        with self._lock:
            entry = self._entries.get(adapter_id)
            if entry is None:
                return None
            adapter = entry[1]
            if adapter.digest != digest:
                self._remove(adapter_id)
                return None
            if record is not None:
                self._entries[adapter_id] = (record, adapter)
            self._entries.move_to_end(adapter_id)
            return adapter

    def known_record(self, adapter_id: str) -> AdapterRecord | None:
        """The record a cached adapter was last served under (None when not cached)."""
        with self._lock:
            entry = self._entries.get(adapter_id)
            return None if entry is None else entry[0]

    def put(
        self,
        adapter_id: str,
        adapter: OptimizedAdapter,
        record: AdapterRecord,
        generation: int,
        registered: bool = False,
    ) -> bool:
        """Cache the payload of `record` (record.digest == adapter.digest), read from the registry
        after `generation()` answered `generation`, or written to it (`registered`) after; False
        (nothing cached) when the adapter was dropped or put (registered) since, for `record` may be
        deleted or replaced by now. True otherwise, also for a payload over the byte budget, which
        is not cached."""
        evicted: list[tuple[str, OptimizedAdapter]] = []
        with self._lock:
            if generation < self._changes.since(adapter_id, REGISTERED if registered else PUT):
                return False
            self._changed(adapter_id, registered)
            self._remove(adapter_id)
            if adapter.total_bytes > self.max_bytes:
                return True
            self._entries[adapter_id] = (record, adapter)
            self._bytes += adapter.total_bytes
            while len(self._entries) > self.max_adapters or self._bytes > self.max_bytes:
                victim, (_, old) = self._entries.popitem(last=False)
                self._bytes -= old.total_bytes
                evicted.append((victim, old))
        if self._on_evict:
            for victim, old in evicted:
                self._on_evict(victim, old)
        return True

    def drop(self, adapter_id: str) -> None:
        """Remove the adapter's payload, and refuse puts of records read before now."""
        with self._lock:
            self._changed(adapter_id, True)
            self._remove(adapter_id)

    def _changed(self, adapter_id: str, registered: bool) -> None:
        """A put, or a drop or registration (`registered`) of the adapter, now."""
        self._changes.change(adapter_id, (PUT, REGISTERED) if registered else (PUT,))

    def _remove(self, adapter_id: str) -> None:
        old = self._entries.pop(adapter_id, None)
        if old is not None:
            self._bytes -= old[1].total_bytes

    def __contains__(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes
