"""Notices adapters re-registered or deleted at the store by comparing what this worker holds with
the store's registry (ListAdapters) every `interval_s`, on the event loop, and announces each
change as an invalidation through the coordinator, so every worker sharing it drops its copy.
This is how a worker learns of changes when the store and it share no Redis, and of those whose
events a Redis that lost its data took with it (`check_soon`, from the coordinator sync). The
store's listing is the truth here: a store whose registry Redis lost restores it before it answers
(adapter_store/registry_mirror.py), so an empty Redis never reads as every adapter deleted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from loraserve.inference_worker.errors import WorkerError

log = logging.getLogger(__name__)


class StoreCheck:
    def __init__(
        self,
        list_digests: Callable[[], Awaitable[dict[str, str]]],
        known_digests: Callable[[], dict[str, str]],
        publish: Callable[[str, str, str], None],
        interval_s: float = 2.0,
    ) -> None:
        self._list_digests, self._known, self._publish = list_digests, known_digests, publish
        self.interval_s = interval_s
        self._published: set[tuple[str, str]] = set()  # (id, digest) already announced
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None  # set: check now, not at the end of the interval

    async def check(self) -> int:
        """Publish an invalidation for each held adapter whose digest changed at the store or
        that is gone there; returns how many."""
        store = await self._list_digests()
        published = 0
        for adapter_id, digest in self._known().items():
            now = store.get(adapter_id, "")
            if now != digest and (adapter_id, now) not in self._published:
                self._publish(adapter_id, now, "registered" if now else "deleted")
                self._published.add((adapter_id, now))
                published += 1
        return published

    async def _run(self) -> None:
        while True:
            try:
                await self.check()
            except WorkerError as exc:  # store unreachable: keep serving what we hold
                log.debug("adapter store check failed: %s", exc)
            except Exception:
                log.exception("adapter store check failed")
            assert self._wake is not None
            with contextlib.suppress(asyncio.TimeoutError):  # TimeoutError's alias from 3.11 on
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._wake = loop, asyncio.Event()
        self._task = loop.create_task(self._run())

    def check_soon(self) -> None:
        """Run the next check now (from any thread); nothing when not started."""
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
