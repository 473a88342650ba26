"""Which adapter fetch goes next when every fetch thread is busy: one that a request (or an
operator's call) waits for, before one that only brings an adapter in ahead of need.

Popularity prefetch starts up to `max_prefetch` fetches a round, tens of MB each; without an order,
a request whose adapter must come from the store queued behind them for as long as they took. The
gate admits `capacity` fetches at once (the source's fetch threads) and, when one ends, lets in the
waiting fetch that is urgent at that moment (a prefetch joined by a request becomes urgent), the
earliest first; the others in arrival order. Runs on the fetches' event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass


@dataclass
class _Waiter:
    future: asyncio.Future[None]
    urgent: Callable[[], bool]


class FetchGate:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a fetch gate admits at least one fetch at a time, not {capacity}")
        self.capacity = capacity
        self.running = 0
        self._waiting: list[_Waiter] = []  # in arrival order
        self._closed: Callable[[], BaseException] | None = None
        self.num_queued = 0  # fetches that waited for a thread
        self.num_ahead = 0  # urgent fetches let in before others that had waited longer

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @asynccontextmanager
    async def slot(self, urgent: Callable[[], bool]) -> AsyncIterator[None]:
        """Hold one of the gate's places for the body; `urgent()` is asked whenever a place frees
        while this waits."""
        await self._enter(urgent)
        try:
            yield
        finally:
            self._leave()

    def close(self, error: Callable[[], BaseException]) -> None:
        """No more fetches: those waiting fail with `error()`, and so does every later one."""
        self._closed = error
        waiting, self._waiting = self._waiting, []
        for waiter in waiting:
            if not waiter.future.done():
                waiter.future.set_exception(error())

    async def _enter(self, urgent: Callable[[], bool]) -> None:
        if self._closed is not None:
            raise self._closed()
        if self.running < self.capacity and not self._waiting:
            self.running += 1
            return
        waiter = _Waiter(asyncio.get_running_loop().create_future(), urgent)
        self._waiting.append(waiter)
        self.num_queued += 1
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self._leave()  # let in just as it was cancelled: the place goes to the next
            elif waiter in self._waiting:
                self._waiting.remove(waiter)
            raise

    def _leave(self) -> None:
        self.running -= 1
        while self.running < self.capacity and self._waiting:
            i = next((i for i, w in enumerate(self._waiting) if _is_urgent(w)), 0)
            passed = any(not w.future.done() for w in self._waiting[:i])
            waiter = self._waiting.pop(i)
            if waiter.future.done():  # cancelled while it waited
                continue
            self.num_ahead += passed
            self.running += 1
            waiter.future.set_result(None)


def _is_urgent(waiter: _Waiter) -> bool:
    if waiter.future.done():
        return False
    try:
        return bool(waiter.urgent())
    except Exception:  # a question about urgency never stops a fetch
        return False
