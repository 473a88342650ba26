"""Typed clients of InferenceWorker, sync (`WorkerClient`) and asyncio (`AsyncWorkerClient`).

    with WorkerClient("127.0.0.1:50052") as w:
        print(w.generate("Hello", max_tokens=20).text)
        for delta in w.generate_stream("Once upon a time", temperature=0.8, seed=1):
            print(delta.text, end="", flush=True)
        for delta in w.generate_stream("Once", max_tokens=64, ignore_eos=True, stream_interval=16):
            print(len(delta.token_ids))  # 1, 16, 16, 16, 15 (outputs that queued may merge)
        chat = w.generate(messages=[{"role": "user", "content": "Hi!"}], n=2, logprobs=True)
        for c in chat.completions:
            print(c.index, c.text, [lp.logprob for lp in c.logprobs])

Failures surface as `grpc.RpcError` with the server's status code and message.

Deadlines: `timeout` (the client's, or a call's own) bounds a whole call, a stream's included, and
its wait for the first message with it (a long queue or prefill is no failure within it).
Without one a unary call gets DEFAULT_TIMEOUT_S, and a stream none, so a long generation runs to
its end; but such a stream's first message must come within `first_message_timeout`
(FIRST_MESSAGE_TIMEOUT_S; None: no bound), else the call is cancelled and FirstMessageTimeout
(DEADLINE_EXCEEDED) raised: a worker that accepts the call and never answers holds no caller for
good. A stream's own `first_message_timeout` bounds its first message whatever its deadline (the
gateway's --first-message-timeout-s). The channel's keepalive (`channel.Keepalive`; None: off) ends any call to a peer that is
gone, a stream in mid-generation too, within its interval and timeout (UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import grpc

from loraserve.clients.channel import (
    KEEPALIVE,
    AsyncChannelClient,
    ChannelClient,
    Keepalive,
    bearer_metadata,
    open_aio_channel,
    open_channel,
)
from loraserve.clients.worker_messages import (
    Delta,
    Generation,
    build_request,
    delta_from_pb,
    generation_from_pb,
)
from loraserve.v1 import worker_pb2, worker_pb2_grpc

TIERS = {"gpu": worker_pb2.ADAPTER_TIER_GPU, "cpu": worker_pb2.ADAPTER_TIER_CPU}
DEFAULT_TIMEOUT_S = 600.0  # a unary call's deadline when none is given (a long Generate fits)
FIRST_MESSAGE_TIMEOUT_S = 60.0  # a stream's wait for its first message: queue, adapter load, prefill


class FirstMessageTimeout(grpc.RpcError):
    """DEADLINE_EXCEEDED: a stream's first message did not come within `seconds` (the worker holds
    the call and does not answer, or queued it that long); the call was cancelled."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no message within {seconds:g} s of the stream's start")
        self.seconds = seconds

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return str(self)


class _FirstMessageWatch:
    """Cancels a sync stream whose first message has not come within `seconds` (None: never)."""

    def __init__(self, call: grpc.Call, seconds: float | None) -> None:
        self.seconds, self.expired, self._call = seconds, False, call
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        if seconds is not None:
            self._timer = threading.Timer(seconds, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            if self._timer is None:  # the first message came first
                return
            self.expired = True
        self._call.cancel()

    def end(self) -> None:
        """The first message came (or the stream ended): no cancel from here on."""
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()


class _Base:
    """What both clients share: the channel (sync or grpc.aio, opened by the subclass's `_open`)
    with its keepalive, the stub, the deadlines and the bearer tokens of generation and admin calls."""

    channel: Any
    stub: Any
    _open: Callable[..., Any]  # open_channel or open_aio_channel

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        admin_token: str | None = None,
        tls_ca: str | None = None,
        timeout: float | None = None,
        first_message_timeout: float | None = FIRST_MESSAGE_TIMEOUT_S,
        keepalive: Keepalive | None = KEEPALIVE,
        interceptors: Sequence[Any] = (),
        tls: bool = False,
        own_connection: bool = False,
    ) -> None:
        self._token, self._admin_token, self.timeout = token, admin_token, timeout
        self.first_message_timeout = first_message_timeout
        # interceptors: grpc.aio client interceptors (the asyncio client only), e.g. trace propagation
        extra: dict[str, Any] = {"interceptors": interceptors} if interceptors else {}
        options = keepalive.options() if keepalive is not None else []
        if own_connection:  # not shared with this process's other channels to the same address
            options.append(("grpc.use_local_subchannel_pool", 1))
        if options:
            extra["options"] = options
        self.channel = self._open(address, tls=tls, root_certificates=tls_ca, **extra)
        self.stub = worker_pb2_grpc.InferenceWorkerStub(self.channel)

    def _md(self, admin: bool = False) -> tuple[tuple[str, str], ...] | None:
        return bearer_metadata(self._admin_token if admin else self._token)

    def _unary(self, timeout: float | None = None) -> float:
        """A unary call's deadline: its own, else the client's, else DEFAULT_TIMEOUT_S."""
        return timeout or self.timeout or DEFAULT_TIMEOUT_S

    def _first_message(self, timeout: float | None, bound: float | None = None) -> float | None:
        """A stream's bound on its first message: the call's own `bound` when it sets one (a caller
        that takes a worker silent that long for hung, within whatever deadline), else
        first_message_timeout when the stream has no deadline (its own or the client's), else none,
        the deadline being the caller's bound."""
        if bound is not None:
            return bound
        return None if timeout or self.timeout else self.first_message_timeout


class WorkerClient(_Base, ChannelClient):
    channel: grpc.Channel
    stub: worker_pb2_grpc.InferenceWorkerStub
    _open = staticmethod(open_channel)

    def generate(
        self, prompt: str | Sequence[int] | None = None, *, timeout: float | None = None, **kw
    ) -> Generation:
        r = self.stub.Generate(build_request(prompt, **kw), metadata=self._md(), timeout=self._unary(timeout))
        return generation_from_pb(r)

    def generate_stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        timeout: float | None = None,
        first_message_timeout: float | None = None,
        **kw,
    ) -> Iterator[Delta]:
        call = self.stub.GenerateStream(
            build_request(prompt, **kw), metadata=self._md(), timeout=timeout or self.timeout
        )
        watch = _FirstMessageWatch(call, self._first_message(timeout, first_message_timeout))
        try:
            for r in call:
                watch.end()
                yield delta_from_pb(r)
        except grpc.RpcError as exc:
            # the error is the call itself, raised from a frame of gRPC's that holds the call: that
            # traceback is a reference cycle (the call, its state, this frame and its caller's, all
            # left to the garbage collector). Raised on from here, without it.
            exc.__traceback__ = None
            if watch.expired:
                raise FirstMessageTimeout(watch.seconds or 0.0) from None
            raise exc
        finally:
            watch.end()
            call.cancel()
            del call, watch  # (nor may this frame, which the error's traceback holds, hold the call)

    def info(self) -> worker_pb2.WorkerInfo:
        return self.stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=self._unary())

    def load_adapter(self, adapter_id: str, tier: str = "gpu") -> worker_pb2.WorkerAdapter:
        return self.stub.LoadAdapter(
            worker_pb2.LoadAdapterRequest(adapter_id=adapter_id, tier=TIERS[tier]),
            metadata=self._md(admin=True),
            timeout=self._unary(),
        ).adapter

    def unload_adapter(self, adapter_id: str) -> bool:
        return self.stub.UnloadAdapter(
            worker_pb2.UnloadAdapterRequest(adapter_id=adapter_id),
            metadata=self._md(admin=True),
            timeout=self._unary(),
        ).unloaded

    def pin_adapter(self, adapter_id: str, pinned: bool = True) -> worker_pb2.WorkerAdapter:
        return self.stub.PinAdapter(
            worker_pb2.PinAdapterRequest(adapter_id=adapter_id, pinned=pinned),
            metadata=self._md(admin=True),
            timeout=self._unary(),
        ).adapter

    def list_adapters(self) -> list[worker_pb2.WorkerAdapter]:
        return list(
            self.stub.ListAdapters(worker_pb2.ListWorkerAdaptersRequest(), timeout=self._unary()).adapters
        )


class AsyncWorkerClient(_Base, AsyncChannelClient):
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.InferenceWorkerAsyncStub
    _open = staticmethod(open_aio_channel)

    async def generate(
        self, prompt: str | Sequence[int] | None = None, *, timeout: float | None = None, **kw
    ) -> Generation:
        r = await self.stub.Generate(
            build_request(prompt, **kw), metadata=self._md(), timeout=self._unary(timeout)
        )
        return generation_from_pb(r)

    def open_stream(
        self, prompt: str | Sequence[int] | None = None, *, timeout: float | None = None, **kw
    ) -> grpc.aio.UnaryStreamCall:
        """The GenerateStream call itself: its GenerateStreamResponse messages as they come (`async
        for`), for a caller that reads them raw (the load generator); it cancels the call when done.
        Its first message has no bound of its own: only `timeout` (and the keepalive) end it."""
        return self.stub.GenerateStream(
            build_request(prompt, **kw), metadata=self._md(), timeout=timeout or self.timeout
        )

    async def generate_stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        timeout: float | None = None,
        first_message_timeout: float | None = None,
        **kw,
    ) -> AsyncIterator[Delta]:
        call = self.open_stream(prompt, timeout=timeout, **kw)
        messages = call.__aiter__()
        first_s = self._first_message(timeout, first_message_timeout)
        try:
            try:
                first = await asyncio.wait_for(messages.__anext__(), first_s)
            except asyncio.TimeoutError:
                raise FirstMessageTimeout(first_s or 0.0) from None
            except StopAsyncIteration:
                return
            yield delta_from_pb(first)
            async for r in messages:
                yield delta_from_pb(r)
        finally:
            call.cancel()

    async def info(self) -> worker_pb2.WorkerInfo:
        return await self.stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=self._unary())

    async def load_adapter(self, adapter_id: str, tier: str = "gpu") -> worker_pb2.WorkerAdapter:
        r = await self.stub.LoadAdapter(
            worker_pb2.LoadAdapterRequest(adapter_id=adapter_id, tier=TIERS[tier]),
            metadata=self._md(admin=True),
            timeout=self._unary(),
        )
        return r.adapter

    async def unload_adapter(self, adapter_id: str) -> bool:
        r = await self.stub.UnloadAdapter(
            worker_pb2.UnloadAdapterRequest(adapter_id=adapter_id),
            metadata=self._md(admin=True),
            timeout=self._unary(),
        )
        return r.unloaded

    async def pin_adapter(self, adapter_id: str, pinned: bool = True) -> worker_pb2.WorkerAdapter:
        r = await self.stub.PinAdapter(
            worker_pb2.PinAdapterRequest(adapter_id=adapter_id, pinned=pinned),
            metadata=self._md(admin=True),
            timeout=self._unary(),
        )
        return r.adapter

    async def list_adapters(self) -> list[worker_pb2.WorkerAdapter]:
        r = await self.stub.ListAdapters(worker_pb2.ListWorkerAdaptersRequest(), timeout=self._unary())
        return list(r.adapters)


class ClientTurns:
    """`connections` asyncio clients of one worker, each on a connection of its own when there
    are several (gRPC otherwise shares one connection per address in a process), taken in turn:
    a worker with several front processes (--stream-processes) gets each connection on one of
    them. `kw` are AsyncWorkerClient's arguments but `own_connection`, which this sets."""

    def __init__(self, address: str, connections: int = 1, **kw: Any) -> None:
        if connections < 1:
            raise ValueError("connections must be >= 1")
        self.clients = [
            AsyncWorkerClient(address, own_connection=connections > 1, **kw) for _ in range(connections)
        ]
        self._turn = 0

    def next(self) -> AsyncWorkerClient:
        """The client of the next call."""
        client = self.clients[self._turn]
        self._turn = (self._turn + 1) % len(self.clients)
        return client

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
