"""A reader of a call's queue that takes what queued while its event loop was busy as one item:
consecutive items that `mergeable` lets follow one another come out as `merged(run)`, so a loop
that falls behind sends fewer, larger messages instead of falling further behind. The worker's
service reads its outputs with it (output_reader.py), the relay's front its deltas (relay/front.py):
one process each, the same rule. When the loop keeps up, each item comes out as it was queued,
without a run being built."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class RunReader(Generic[T]):
    def __init__(
        self,
        queue: asyncio.Queue[T],
        mergeable: Callable[[T, T], bool],
        merged: Callable[[list[T]], T],
    ) -> None:
        """`mergeable(a, b)`: whether `b` may follow `a` in one item; `merged(run)`: a run of two
        or more such items as one."""
        self.queue, self.mergeable, self.merged = queue, mergeable, merged
        self._held: T | None = None  # taken from the queue and not merged: the next to come out

    async def next(self) -> T:
        """The next item, merged with the ones already queued behind it that may follow it; the
        first that may not is held and comes next."""
        item = self._held if self._held is not None else await self.queue.get()
        self._held = None
        if self.queue.empty():  # kept up: nothing to merge
            return item
        nxt = self.queue.get_nowait()
        if not self.mergeable(item, nxt):
            self._held = nxt
            return item
        run = [item, nxt]
        while not self.queue.empty():
            nxt = self.queue.get_nowait()
            if not self.mergeable(run[-1], nxt):
                self._held = nxt
                break
            run.append(nxt)
        return self.merged(run)
