"""How often each adapter has been asked for lately: request counts with exponential decay, so a
count halves every `half_life_s` without requests. The worker records one count per request with
an adapter and publishes its top entries through the coordinator; the fleet's sum ranks what a
worker with free capacity should prefetch.

    value(t) = sum over requests i of 2^(-(t - t_i) / half_life_s)

Kept as (value at last update, time of last update) per adapter: O(1) per request. Thread-safe.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections.abc import Callable


class PopularityCounter:
    def __init__(
        self,
        half_life_s: float = 60.0,
        *,
        max_entries: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self._rate = math.log(2) / half_life_s
        self._max_entries, self._clock = max_entries, clock
        self._counts: dict[str, tuple[float, float]] = {}  # adapter id -> (value, at)
        self._lock = threading.Lock()

    def _decayed(self, value: float, at: float, now: float) -> float:
        return value * math.exp(-self._rate * (now - at))

    def record(self, adapter_id: str, n: float = 1.0) -> None:
        now = self._clock()
        with self._lock:
            value, at = self._counts.get(adapter_id, (0.0, now))
            self._counts[adapter_id] = (self._decayed(value, at, now) + n, now)
            if len(self._counts) > 2 * self._max_entries:
                self._trim(now)

    def _trim(self, now: float) -> None:
        keep = heapq.nlargest(
            self._max_entries, self._counts.items(), key=lambda kv: self._decayed(kv[1][0], kv[1][1], now)
        )
        self._counts = dict(keep)

    def top(self, k: int, min_count: float = 0.01) -> dict[str, float]:
        """The k most popular adapters now, with their decayed counts (those above min_count)."""
        now = self._clock()
        with self._lock:
            values = {a: self._decayed(v, at, now) for a, (v, at) in self._counts.items()}
        best = heapq.nlargest(k, values.items(), key=lambda kv: kv[1])
        return {a: round(v, 4) for a, v in best if v >= min_count}
