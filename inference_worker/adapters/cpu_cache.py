"""The CPU tier: optimized payloads (pinned memory on CUDA hosts) bounded by a count and a byte
budget, least recently used first out."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from loraserve.inference_worker.lora.payload import AdapterPayload


class CpuCache:
    def __init__(self, max_adapters: int, max_bytes: int) -> None:
        if max_adapters < 1 or max_bytes < 1:
            raise ValueError("the CPU cache needs room for at least one adapter")
        self.max_adapters, self.max_bytes = max_adapters, max_bytes
        self._entries: OrderedDict[str, AdapterPayload] = OrderedDict()
        self.nbytes = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)

    def get(self, key: str) -> AdapterPayload | None:
        """The payload under `key`, marked most recently used."""
        payload = self._entries.get(key)
        if payload is not None:
            self._entries.move_to_end(key)
        return payload

    def peek(self, key: str) -> AdapterPayload | None:
        return self._entries.get(key)

    def put(self, payload: AdapterPayload, keep: Callable[[str], bool] | None = None) -> list[str]:
        """Insert (as most recently used) and evict LRU entries past the budgets; returns the keys
        evicted. Entries `keep` answers True for (adapters queued requests wait for) leave only
        when nothing else is left to evict. A payload larger than the whole byte budget is refused
        with ValueError."""
        if payload.nbytes > self.max_bytes:
            raise ValueError(
                f"adapter {payload.adapter_id} needs {payload.nbytes} bytes, over the CPU "
                f"cache budget of {self.max_bytes}"
            )
        self.remove(payload.key)
        self._entries[payload.key] = payload
        self.nbytes += payload.nbytes
        evicted: list[str] = []
        if self._within_budgets():
            return evicted
        for key in self._eviction_order(keep):  # usually one entry goes
            self.remove(key)
            evicted.append(key)
            if self._within_budgets():
                break
        return evicted

    def _eviction_order(self, keep: Callable[[str], bool] | None) -> Iterator[str]:
        """LRU first, the kept ones (in LRU order) once nothing else is left; lazily, so a put
        that evicts one entry asks `keep` about a few at the LRU end, not about every entry."""
        kept: list[str] = []
        for key in list(self._entries):
            if keep is not None and keep(key):
                kept.append(key)
            else:
                yield key
        yield from kept

    def _within_budgets(self) -> bool:
        return len(self._entries) <= self.max_adapters and self.nbytes <= self.max_bytes

    @property
    def room(self) -> int:
        """Entries that fit before anything is evicted (by count, and by bytes at the mean size)."""
        by_count = self.max_adapters - len(self._entries)
        if not self._entries:
            return by_count
        mean = self.nbytes / len(self._entries)
        return max(0, min(by_count, int((self.max_bytes - self.nbytes) // max(mean, 1.0))))

    def remove(self, key: str) -> bool:
        old = self._entries.pop(key, None)
        if old is None:
            return False
        self.nbytes -= old.nbytes
        return True
