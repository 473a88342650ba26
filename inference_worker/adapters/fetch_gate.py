"""Which adapter fetch goes next when the fetch threads are busy: one that a request (or an
operator's call) waits for, before one that only brings an adapter in ahead of need.

Popularity prefetch starts up to `max_prefetch` fetches a round, tens of MB each; without an order,
a request whose adapter must come from the store queued behind them for as long as they took. The
gate admits `capacity` fetches at once (the source's fetch threads), of which fetches that nobody
waits for may hold all but one: a request's fetch starts at once unless urgent fetches hold every
place. When one ends, it lets in the waiting fetch that is urgent at that moment (a prefetch that a
request joined is), the earliest first; the others in arrival order. Runs on the fetches' event
loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass


@dataclass
class _Waiter:
    future: asyncio.Future[bool]  # -> whether it holds its place as a fetch nobody waits for
    urgent: Callable[[], bool]


class FetchGate:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a fetch gate admits at least one fetch at a time, not {capacity}")
        self.capacity = capacity
        self.reserved = 1 if capacity > 1 else 0  # places that only urgent fetches take
        self.running = 0
        self.background = 0  # places held by fetches that nobody waited for when let in
        self._waiting: list[_Waiter] = []  # in arrival order
        self._closed: Callable[[], BaseException] | None = None

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @asynccontextmanager
    async def slot(self, urgent: Callable[[], bool]) -> AsyncIterator[None]:
        """Hold one of the gate's places for the body; `urgent()` is asked as it arrives and
        whenever a place frees while it waits."""
        background = await self._enter(urgent)
        try:
            yield
        finally:
            self._leave(background)

    def close(self, error: Callable[[], BaseException]) -> None:
        """No more fetches: those waiting fail with `error()`, and so does every later one."""
        self._closed = error
        waiting, self._waiting = self._waiting, []
        for waiter in waiting:
            if not waiter.future.done():
                waiter.future.set_exception(error())

    async def _enter(self, urgent: Callable[[], bool]) -> bool:
        """In once a place is free for it; -> whether it holds it as a fetch nobody waits for."""
        if self._closed is not None:
            raise self._closed()
        waiter = _Waiter(asyncio.get_running_loop().create_future(), urgent)
        self._waiting.append(waiter)
        self._let_in()
        if waiter.future.done():  # in at once
            return waiter.future.result()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self._leave(waiter.future.result())  # let in just as it was cancelled: pass it on
            elif waiter in self._waiting:
                self._waiting.remove(waiter)
            raise

    def _leave(self, background: bool) -> None:
        self.running -= 1
        self.background -= background
        self._let_in()

    def _let_in(self) -> None:
        self._waiting = [w for w in self._waiting if not w.future.done()]  # given up while waiting
        while self.running < self.capacity and self._waiting:
            i = next((i for i, w in enumerate(self._waiting) if _asks_urgently(w.urgent)), None)
            background = i is None
            if i is None:
                if self.background >= self.capacity - self.reserved:
                    return  # the place left is for an urgent fetch
                i = 0
            waiter = self._waiting.pop(i)
            self.running += 1
            self.background += background
            waiter.future.set_result(background)


def _asks_urgently(urgent: Callable[[], bool]) -> bool:
    try:
        return bool(urgent())
    except Exception:  # a question about urgency never stops a fetch
        return False
