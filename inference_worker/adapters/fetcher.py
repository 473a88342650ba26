"""Single-flight fetches from the adapter source (the store) on the worker's event loop.

However many sequences and admin calls want one version, one fetch runs; every sequence waiting
for it is remembered, so a failed fetch fails exactly those (the next request tries again). A
fetch that an invalidation overtook (the store changed the adapter meanwhile) is repeated. With
every fetch thread of the source busy, the fetch somebody waits for goes next (fetch_gate.py).

A flight's outcome is a value (the version key, or the error), never an exception kept raised:
the flight's future, the task and each waiter would hold the error's traceback, its frames (the
fetch's gRPC call and buffer; on the step thread, the scheduler's) and the flight itself in a
reference cycle, which only the garbage collector frees, stopping every thread while it does. The
error is kept without traceback, and whoever raises it (a waiter's admission, an operator's load)
raises a copy of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Protocol

from loraserve.inference_worker.adapters.fetch_gate import FetchGate
from loraserve.inference_worker.adapters.metrics import AdapterMetrics
from loraserve.inference_worker.adapters.refs import AdapterRef
from loraserve.inference_worker.errors import DependencyUnavailable, NoAdapterStore, WorkerError, detached
from loraserve.inference_worker.lora.payload import AdapterPayload
from loraserve.serving import tracing

MAX_STALE_RETRIES = 3
MAX_FAILED_KEPT = 4096


class AdapterSource(Protocol):
    """Where adapters come from. A source with a `max_fetches` attribute runs that many fetches at
    once; the fetcher then sends it no more, urgent ones first (fetch_gate.py)."""

    async def fetch(self, adapter_id: str, digest: str = "") -> AdapterPayload: ...


class Installer(Protocol):
    """What a finished fetch is handed to (the adapter pool): `check` (any thread) raises when the
    payload does not fit this worker; `generation` and `install` run with the state lock held."""

    def generation(self, adapter_id: str) -> int: ...

    def check(self, payload: AdapterPayload) -> None: ...

    def install(self, payload: AdapterPayload, generation: int) -> bool: ...


@dataclass
class Flight:
    ref: AdapterRef
    waiters: set[int] = field(default_factory=set)  # sequence keys
    # -> version key "id@digest", or the failure (see the module's text)
    future: concurrent.futures.Future[str | WorkerError] | None = None
    trace_context: object = None  # of the request (or admin call) that started it; None while off
    awaited: bool = False  # a caller other than a queued request waits for it (an operator's load)

    def urgent(self) -> bool:
        """Someone waits for it: before fetches that only bring adapters in ahead of need."""
        return self.awaited or bool(self.waiters)


class AdapterFetcher:
    def __init__(
        self,
        source: AdapterSource | None,
        installer: Installer,
        lock: threading.RLock,
        metrics: AdapterMetrics,
    ) -> None:
        self.source, self._installer, self._lock, self.metrics = source, installer, lock, metrics
        self.flights: dict[AdapterRef, Flight] = {}
        self._failed: dict[int, WorkerError] = {}  # sequence key -> why its adapter cannot load
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listeners: list[Callable[[], None]] = []
        limit = getattr(source, "max_fetches", None)
        self.gate: FetchGate | None = FetchGate(limit) if isinstance(limit, int) and limit > 0 else None

    def start(self, loop: asyncio.AbstractEventLoop, on_done: Callable[[], None] | None = None) -> None:
        """Fetches run on `loop`; `on_done` is called (from the loop) whenever one ends."""
        self._loop = loop
        if on_done is not None:
            self._listeners.append(on_done)

    # ------------------------------------------------------------------ under the state lock
    def fetch(self, ref: AdapterRef, waiter: int | None = None, awaited: bool = False) -> Flight:
        """The flight bringing `ref` in, started unless one already is; `waiter` (a sequence key)
        learns of its failure through `raise_failure`; `awaited`: the caller waits for the flight
        itself (both make it urgent)."""
        flight = self.flights.get(ref)
        if flight is None:
            if self.source is None:
                raise NoAdapterStore()
            if self._loop is None or self._loop.is_closed():
                raise DependencyUnavailable("the worker's adapters are not running (no event loop)")
            flight = Flight(ref, trace_context=tracing.current_context())
            self.flights[ref] = flight
            flight.future = asyncio.run_coroutine_threadsafe(self._fly(flight), self._loop)
        if waiter is not None:
            flight.waiters.add(waiter)
        flight.awaited |= awaited
        return flight

    def raise_failure(self, seq_key: int) -> None:
        """Raise why the fetch the sequence waited for failed, once; nothing when it did not. A copy
        of the flight's error, its own to carry the frames it goes through, held by none of them."""
        failed = self._failed.pop(seq_key, None)
        if failed is not None:
            raise copy.copy(failed)

    def has_failed(self, seq_key: int) -> bool:
        """A fetch the sequence waited for failed; it learns why at its next admission attempt."""
        return seq_key in self._failed

    def forget(self, seq_key: int) -> None:
        """The sequence left (finished, cancelled): stop tracking it."""
        self._failed.pop(seq_key, None)
        for f in self.flights.values():
            f.waiters.discard(seq_key)

    # ------------------------------------------------------------------ event loop
    async def _fly(self, flight: Flight) -> str | WorkerError:
        attributes = {"loraserve.adapter.id": flight.ref.adapter_id, "loraserve.adapter.tier": "cpu"}
        with tracing.span("worker.adapter_load", attributes, parent=flight.trace_context) as span:
            try:
                got = await self._fetch(flight)
            # cancelled only as the loop stops: the waiters shield the flight (AdapterPool.ensure_cpu)
            except asyncio.CancelledError:
                return DependencyUnavailable(f"the fetch of adapter {flight.ref.adapter_id!r} was cancelled")
            if isinstance(got, WorkerError):
                tracing.set_error(span, got.message)
            else:
                tracing.annotate({"loraserve.adapter.version": got}, span)
            return got

    async def _fetch(self, flight: Flight) -> str | WorkerError:
        assert self.source is not None
        ref, t0 = flight.ref, time.perf_counter()
        try:
            for _ in range(MAX_STALE_RETRIES):
                with self._lock:
                    generation = self._installer.generation(ref.adapter_id)
                async with self.gate.slot(flight.urgent) if self.gate is not None else nullcontext():
                    payload = await self.source.fetch(ref.adapter_id, ref.digest)
                self._installer.check(payload)
                with self._lock:
                    if self._installer.install(payload, generation):
                        seconds = time.perf_counter() - t0
                        self.metrics.observe_load("cpu", ref.adapter_id, seconds)
                        if payload.transport:
                            self.metrics.fetch_transport.labels(payload.transport).inc()
                        tracing.annotate(
                            {"loraserve.load_ms": seconds * 1e3, "loraserve.bytes": payload.nbytes}
                        )
                        return payload.key
            raise DependencyUnavailable(
                f"adapter {ref.adapter_id!r} kept changing at the store while fetching"
            )
        except Exception as exc:
            err = detached(
                exc
                if isinstance(exc, WorkerError)
                else DependencyUnavailable(
                    f"fetching adapter {ref.adapter_id!r} failed: {type(exc).__name__}: {exc}"
                )
            )
            self.metrics.loads.labels("cpu", err.code.lower()).inc()
            with self._lock:
                for seq_key in flight.waiters:
                    self._failed[seq_key] = err
                # a sequence cancelled while waiting never comes back for its failure: keep few
                for seq_key in list(self._failed)[: max(0, len(self._failed) - MAX_FAILED_KEPT)]:
                    del self._failed[seq_key]
            return err
        finally:
            with self._lock:
                if self.flights.get(ref) is flight:
                    del self.flights[ref]
            for listener in self._listeners:
                listener()

    def close(self) -> None:
        """On the loop, as the worker stops: fetches waiting for a fetch thread fail (UNAVAILABLE)
        instead of waiting for a source that is closing."""
        if self.gate is not None:
            self.gate.close(lambda: DependencyUnavailable("the worker's adapter fetches are stopping"))

    def run_on_loop(self, coro) -> None:  # type: ignore[no-untyped-def]
        """Schedule a coroutine on the fetch loop (from any thread); dropped when none runs."""
        if self._loop is not None and not self._loop.is_closed():
            asyncio.run_coroutine_threadsafe(coro, self._loop)
        else:
            coro.close()
