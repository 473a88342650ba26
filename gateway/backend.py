"""Where the gateway's generations go: one worker, or the fleet through the adapter-aware router.

With --redis-url the live workers are read from their heartbeats every `route_refresh_s` by a task
of its own, never inside a request: a slow or unreachable Redis stalls no request, which routes
over the last workers read (the --worker address stands in while none heartbeats). Only a request
that comes before any read ended waits for the first one, at most --redis-timeout-s; then --worker
stands in, else it fails UNAVAILABLE (503). Each request tries the workers in the order
`WorkerRouter.candidates` gives: holders of the adapter first, least loaded first. A worker that
answers UNAVAILABLE before streaming anything is marked down and the next one is tried; one whose
stream brings no first message within its bound (--first-message-timeout-s, else the request's
deadline) is marked down too, and the request fails with DEADLINE_EXCEEDED. Calls go
through grpc.aio clients, `worker_connections` per worker address (each its own connection, taken
in turn: a worker's front processes each get some), opened on the serving loop when first used."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Iterator
from contextlib import AbstractContextManager, aclosing, contextmanager, nullcontext, suppress
from typing import Any

import grpc

from loraserve.clients.router import WorkerRouter, WorkerView, discover_workers
from loraserve.clients.store_client import AsyncStoreClient
from loraserve.clients.worker_client import AsyncWorkerClient, ClientTurns
from loraserve.clients.worker_messages import Delta, Generation
from loraserve.gateway.config import GatewayConfig
from loraserve.serving import tracing
from loraserve.v1 import adapter_pb2

log = logging.getLogger("loraserve.gateway")
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)


class Backend:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self._clients: dict[str, ClientTurns] = {}
        self._running: dict[ClientTurns, int] = {}  # the calls running on each worker's clients
        # the clients of workers that left, each closed by its task once no call runs on them (its
        # event in _idle set)
        self._retiring: dict[asyncio.Task[None], ClientTurns] = {}
        self._idle: dict[ClientTurns, asyncio.Event] = {}
        self._router: WorkerRouter | None = None
        self._fleet: tuple[str, ...] = ()
        self._discovery: asyncio.Task[None] | None = None  # reads the live workers (`_discovering`)
        self._read = asyncio.Event()  # set once a read of Redis ended, answered or not
        self._unread = ""  # why the last read of Redis failed; "" when it answered
        self._base_model = config.model_name
        self._store: AsyncStoreClient | None = None
        self._first_message_s = config.first_message_timeout_s or None  # 0: the deadline's alone

    @property
    def store(self) -> AsyncStoreClient | None:
        """The store's client (none without --store), opened on first use: grpc.aio channels belong
        to the event loop they are opened on, the server's."""
        if self._store is None and self.config.store:
            self._store = AsyncStoreClient(self.config.store, token=self.config.store_token, timeout=10)
        return self._store

    # ------------------------------------------------------------------------------ workers
    def _turns(self, address: str) -> ClientTurns:
        turns = self._clients.get(address)
        if turns is None:
            turns = self._clients[address] = ClientTurns(
                address,
                self.config.worker_connections,
                token=self.config.worker_token,
                timeout=self.config.request_timeout_s,
                interceptors=tracing.client_interceptors(),  # the worker continues the request's trace
            )
        return turns

    @contextmanager
    def _calling(self, address: str) -> Iterator[AsyncWorkerClient]:
        """The client of one call (the worker's next turn), counted among the calls running on the
        worker's clients until the block ends."""
        turns = self._turns(address)
        self._running[turns] = self._running.get(turns, 0) + 1
        try:
            yield turns.next()
        finally:
            self._running[turns] -= 1
            if not self._running[turns]:
                del self._running[turns]
                if turns in self._idle:
                    self._idle[turns].set()

    def start(self) -> None:
        """Start reading the live workers from Redis (a task on the serving loop; the first request
        starts it where the application's start-up did not)."""
        if self.config.redis_url and self._discovery is None:
            self._discovery = asyncio.ensure_future(self._discovering())

    async def _discovering(self) -> None:
        while True:
            try:
                await self._discover()
            except Exception:  # unexpected: the next period reads again rather than none ever
                log.exception("updating the live workers failed")
            await asyncio.sleep(self.config.route_refresh_s)

    async def _discover(self) -> None:
        """One read of the live workers (bounded by redis_timeout_s); the router is rebuilt when
        they changed. A read that fails keeps the workers known."""
        assert self.config.redis_url
        try:
            live = await asyncio.to_thread(
                discover_workers,
                self.config.redis_url,
                self.config.redis_prefix,
                timeout_s=self.config.redis_timeout_s,
            )
        except Exception as exc:  # Redis down or silent: keep routing over what we knew
            if not self._unread:  # once per outage
                log.warning("cannot read the live workers from Redis: %s", exc)
            self._unread = str(exc) or type(exc).__name__
            return
        else:
            self._unread = ""
        finally:
            self._read.set()
        self._use(tuple(sorted(set(live))))

    def _use(self, fleet: tuple[str, ...]) -> None:
        """Route over `fleet` from now on, or over --worker when it is empty (a new router when it
        changed; none for no worker)."""
        fleet = fleet or ((self.config.worker,) if self.config.worker else ())
        if fleet and fleet != self._fleet:
            old, self._router = (
                self._router,
                WorkerRouter(
                    fleet,
                    refresh_s=self.config.route_refresh_s,
                    refresh_timeout_s=self.config.worker_read_timeout_s,
                    down_s=self.config.worker_down_s,
                    token=self.config.worker_token,
                ),
            )
            self._fleet = fleet
            if old is not None:
                old.close()
            for address in [a for a in self._clients if a not in fleet and a != self.config.worker]:
                self._retire(self._clients.pop(address))

    async def _first_router(self) -> WorkerRouter:
        """The router of a request that comes before any worker is known: it waits for the first
        read of Redis to end, at most redis_timeout_s; then --worker stands in, else UNAVAILABLE."""
        self.start()
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._read.wait(), self.config.redis_timeout_s)
        if self._router is None:
            self._use(())  # --worker, where given
        if self._router is not None:
            return self._router
        if self._unread:
            why = f"the live workers cannot be read from Redis: {self._unread}"
        elif not self._read.is_set():
            why = f"Redis has not answered the read of the live workers within {self.config.redis_timeout_s:g} s"
        else:
            why = "none heartbeats in Redis"
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details=f"no inference worker is known ({why}, and no --worker given)",
        )

    def _retire(self, turns: ClientTurns) -> None:
        """Close a departed worker's clients as soon as no call runs on them, cancelling those still
        running after request_timeout_s (none outlives it); a worker that comes back gets new ones.
        Not grpc.aio's Channel.close(grace): cancelled within its grace, as when the gateway closes,
        it leaves the channel closing but open, its calls running, and a second close() does nothing."""
        idle = self._idle[turns] = asyncio.Event()
        if turns not in self._running:
            idle.set()

        async def close_when_idle() -> None:
            try:
                with suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(idle.wait(), self.config.request_timeout_s)
            finally:
                self._idle.pop(turns, None)
                await turns.close()  # cancels the calls still running

        task = asyncio.ensure_future(close_when_idle())
        self._retiring[task] = turns
        task.add_done_callback(lambda t: self._retiring.pop(t, None))

    async def candidates(self, adapter_id: str) -> list[tuple[str, WorkerView | None]]:
        """Workers to try for this adapter, best first: (address, the router's view or None). The
        client of an attempt is taken (`client`) only when it is made, so each attempt is one turn."""
        if not self.config.redis_url:
            return [(self.config.worker, None)]
        router = self._router if self._router is not None else await self._first_router()
        views = await asyncio.to_thread(router.candidates, adapter_id)
        return [(v.address, v) for v in views]

    def _mark_down(self, view: WorkerView | None) -> None:
        if view is not None and self._router is not None:
            self._router.mark_down(view)

    def _routed(self, view: WorkerView | None) -> AbstractContextManager[None]:
        """Count the request in the view's load while it runs (the router's choices between refreshes)."""
        if view is None or self._router is None:
            return nullcontext()
        return self._router.routed(view)

    def _note_use(self, view: WorkerView | None, adapter_id: str) -> None:
        if view is not None and self._router is not None:
            self._router.note_use(view, adapter_id)

    async def generate(self, adapter_id: str, **kw: Any) -> Generation:
        last: grpc.RpcError | None = None
        for address, view in await self.candidates(adapter_id):
            try:
                with self._routed(view), self._calling(address) as client:
                    out = await client.generate(adapter_id=adapter_id, **kw)
            except grpc.RpcError as exc:
                if exc.code() not in _RETRYABLE:  # type: ignore[attr-defined]
                    raise
                self._mark_down(view)
                last = exc
                continue
            self._note_use(view, adapter_id)
            return out
        assert last is not None
        raise last

    async def stream(self, adapter_id: str, **kw: Any) -> AsyncGenerator[Delta, None]:
        """The deltas of one generation; closing this iterator cancels the worker's call."""
        last: grpc.RpcError | None = None
        for address, view in await self.candidates(adapter_id):
            started = False
            try:
                with self._routed(view), self._calling(address) as client:
                    # an async generator, typed as an iterator by the client
                    stream = client.generate_stream(
                        adapter_id=adapter_id, first_message_timeout=self._first_message_s, **kw
                    )
                    async with aclosing(stream) as deltas:  # type: ignore[type-var]
                        async for delta in deltas:
                            started = True
                            yield delta
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                if not started and code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # no first message within its bound (FirstMessageTimeout, else the deadline):
                    # the worker hangs, or queues that long; the next requests go elsewhere
                    self._mark_down(view)
                    raise
                if started or code not in _RETRYABLE:
                    raise
                self._mark_down(view)
                last = exc
                continue
            self._note_use(view, adapter_id)
            return
        assert last is not None
        raise last

    # ------------------------------------------------------------------------------- models
    async def base_model(self) -> str:
        """The base model's name: --model-name, else what the (first) worker reports."""
        if not self._base_model:
            address, _ = (await self.candidates(""))[0]
            with self._calling(address) as client:
                self._base_model = (await client.info()).model
        return self._base_model

    async def adapters(self) -> list[adapter_pb2.AdapterInfo]:
        """Every adapter registered in the store (none without --store)."""
        if self.store is None:
            return []
        return [a async for a in self.store.list()]

    async def close(self) -> None:
        if self._discovery is not None:  # (a read in flight ends in its thread by redis_timeout_s)
            self._discovery.cancel()
            await asyncio.gather(self._discovery, return_exceptions=True)
            self._discovery = None
        for turns in self._clients.values():
            await turns.close()
        self._clients.clear()
        for task, turns in list(self._retiring.items()):  # their calls end with the server: cancelled now
            task.cancel()
            await turns.close()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        self._retiring.clear()
        self._idle.clear()
        if self._store is not None:
            await self._store.close()
            self._store = None
        if self._router is not None:
            self._router.close()
            self._router = None
