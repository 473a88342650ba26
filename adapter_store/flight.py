"""Single flight: concurrent calls with the same key share one execution of the work.

The work runs as its own task, so a caller that goes away (a cancelled RPC) does not cancel it
for the others; the key is released when the work ends, success or failure.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")


class SingleFlight:
    def __init__(self) -> None:
        self._tasks: dict[Hashable, asyncio.Task[Any]] = {}

    async def do(self, key: Hashable, work: Callable[[], Awaitable[T]]) -> T:
        task = self._tasks.get(key)
        if task is None:
            task = asyncio.ensure_future(work())
            self._tasks[key] = task
            task.add_done_callback(functools.partial(self._release, key))
        return await asyncio.shield(task)

    def _release(self, key: Hashable, task: asyncio.Task[Any]) -> None:
        if self._tasks.get(key) is task:
            del self._tasks[key]
        if not task.cancelled():
            task.exception()  # mark retrieved: every waiter has seen it already

    def __len__(self) -> int:
        return len(self._tasks)
