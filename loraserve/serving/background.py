"""A gRPC server running on an event loop of its own in a daemon thread: how the embedded
default (`loraserve up`) and the tests run a store or a worker inside another program."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

S = TypeVar("S")


class BackgroundServer(Generic[S]):
    """`start()` (run on the new loop) returns (server, bound port); errors raise here."""

    def __init__(self, start: Callable[[], Awaitable[tuple[S, int]]], host: str, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.server: S | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._run, args=(start,), name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.address = f"{host}:{self.port}"

    def _run(self, start: Callable[[], Awaitable[tuple[S, int]]]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self.server, self.port = self._loop.run_until_complete(start())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    def call(self, coro: Any, timeout: float | None = 60) -> Any:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _shutdown(self, coro: Any, join_s: float) -> None:
        """Run `coro` (the server's stop or drain), then end the loop and its thread."""
        if self.server is None or not self._thread.is_alive():
            coro.close()
            return
        self.call(coro)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(join_s)
