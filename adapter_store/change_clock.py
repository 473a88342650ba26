"""The clock that tells a write of the store's caches whether what it read is still current: the
clock counts changes, and each key keeps when it last changed, per kind of change. A writer takes
`now` before it reads the registry; its write is stale when the key changed since (`since(key,
kind) > generation`). Bounded: past `limit` keys the least recently changed one is forgotten, and its
latest mark becomes the floor, the answer for every key not held (a refused write, never a stale one).

Used by the CPU cache (adapter_store/cache.py: kind 0 a put or drop, kind 1 a drop or registration)
and the hand-over directory (adapter_store/handover.py: kind 0 a discard). Callers hold their own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class ChangeClock:
    def __init__(self, kinds: int, limit: int) -> None:
        self.kinds, self.limit = kinds, limit
        self.now = 0
        self._marks: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # least recently changed first
        self._floor = 0  # the latest mark of the latest key forgotten

    def change(self, key: str, kinds: Iterable[int]) -> None:
        """`key` changed now, in each of `kinds` (its other kinds keep their marks)."""
        self.now += 1
        marks = list(self._marks.pop(key, (self._floor,) * self.kinds))
        for kind in kinds:
            marks[kind] = self.now
        self._marks[key] = tuple(marks)
        if len(self._marks) > self.limit:
            _, forgotten = self._marks.popitem(last=False)
            self._floor = max(self._floor, *forgotten)

    def since(self, key: str, kind: int) -> int:
        """When `key` last changed in `kind` (the floor when it is not held)."""
        marks = self._marks.get(key)
        return self._floor if marks is None else marks[kind]

    def __len__(self) -> int:
        return len(self._marks)
