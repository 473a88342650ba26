"""The worker's end of the stream relay: a Unix socket server that runs each relayed call through
the same method handler and interceptors as the worker's gRPC server (bearer tokens, error
statuses, the access log and tracing), with a context that stands in for gRPC's, and sends what
the call produces back to the front in frames (framing.py).

A relayed call that the front cancels (its client went away or ran out of time) is cancelled here,
which aborts its sequence in the engine, as for a direct call."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from loraserve.inference_worker.relay.deltas import Delta
from loraserve.inference_worker.relay.framing import FrameWriter, read_frame

log = logging.getLogger("loraserve.worker")
CLOSE_FLUSH_S = 2.0  # how long closing waits for the front to take what the calls sent last


class RelayContext:
    """What the worker's handlers and interceptors read from a gRPC servicer context."""

    def __init__(self, timeout: float | None, metadata: Sequence[tuple[str, str]], peer: str) -> None:
        self._deadline = time.monotonic() + timeout if timeout is not None else None
        self._metadata = tuple(metadata)
        self._peer = peer
        self._code: grpc.StatusCode | None = None
        self._details = ""
        # a response-streaming call's messages straight to the front (set by RelayServer._call)
        self.relay_stream: RelayStream | None = None

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self._code, self._details = code, details
        raise grpc.aio.AbortError()


class RelayStream:
    """What a relayed response-streaming call's handler sends to the front beside the messages
    it yields: a response, or a running output's fields (deltas.py); nothing once the call's end
    (or error) is sent."""

    def __init__(
        self, out: FrameWriter, key: int, serialize: Callable[[Any], bytes], text_in_front: bool
    ) -> None:
        self._out, self._key, self._serialize = out, key, serialize
        self.text_in_front = text_in_front  # the front makes this stream's text (front_text.py)
        self.open = True

    def message(self, response: Any) -> None:
        if self.open:
            self._out.add(("message", self._key, self._serialize(response)))

    def delta(self, delta: Delta) -> None:
        if self.open:
            self._out.add(("delta", self._key, delta))


class _Registry:
    """Collects the generic handlers that generated `add_*Servicer_to_server` functions register."""

    def __init__(self) -> None:
        self.handlers: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.handlers.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        pass


class _Details(grpc.HandlerCallDetails):
    def __init__(self, method: str, metadata: Sequence[tuple[str, str]]) -> None:
        self.method, self.invocation_metadata = method, tuple(metadata)


class RelayServer:
    """Relayed calls of `methods` (full names), served by what `add_servicer(servicer, registry)`
    registers, through `interceptors` (outermost first, as the gRPC server has them)."""

    def __init__(
        self,
        servicer: object,
        add_servicer: Any,
        interceptors: Sequence[grpc.aio.ServerInterceptor],
        methods: Sequence[str],
        tokenizer_json: str | None = None,
        fronts: int = 1,
    ) -> None:
        """tokenizer_json: the worker's tokenizer, sent to the front first on each connection
        (it makes the text of the streams it marks); None: the worker makes all text. fronts: the
        front processes that connect (`connected` is set once they all have)."""
        registry = _Registry()
        self._tokenizer_json = tokenizer_json
        add_servicer(servicer, registry)
        self._generic = registry.handlers
        self._interceptors = list(interceptors)
        self._methods = frozenset(methods)
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._writers: set[FrameWriter] = set()
        self.connected = asyncio.Event()  # every front has connected
        self._fronts = fronts
        self.calls_by_connection: list[int] = []  # calls relayed by each connection, in the order they came

    async def start(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._connection, path)

    async def close(self, flush_s: float = CLOSE_FLUSH_S) -> None:
        """Stop relaying. What the calls have sent so far (their final statuses included) is
        written to the front first, for up to `flush_s`, and then the socket is closed: the front
        reads every frame, then the end, and finishes its callers' calls with what it was sent."""
        if self._server is not None:
            self._server.close()
        for out in list(self._writers):
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
                await asyncio.wait_for(out.flush_and_close(), flush_s)
        for task in list(self._connections):
            task.cancel()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        this = asyncio.current_task()
        assert this is not None
        self._connections.add(this)
        connection = len(self.calls_by_connection)
        self.calls_by_connection.append(0)
        if len(self.calls_by_connection) >= self._fronts:
            self.connected.set()
        out = FrameWriter(writer)
        self._writers.add(out)
        if self._tokenizer_json is not None:
            out.add(("tokenizer", -1, self._tokenizer_json))
        calls: dict[int, asyncio.Task[None]] = {}
        try:
            while (ops := await read_frame(reader)) is not None:
                for op in ops:
                    if op[0] == "call":
                        self.calls_by_connection[connection] += 1
                        calls[op[1]] = task = asyncio.ensure_future(self._call(out, *op[1:]))
                        task.add_done_callback(functools.partial(_forget, calls, op[1]))
                    elif op[0] == "cancel" and (running := calls.get(op[1])) is not None:
                        running.cancel()
        except ConnectionError as exc:
            log.error("relay connection closed: %s", exc)
        finally:  # the front is gone: so are its callers
            for task in list(calls.values()):
                task.cancel()
            writer.close()
            self._writers.discard(out)
            self._connections.discard(this)

    async def _handler(
        self, method: str, metadata: Sequence[tuple[str, str]]
    ) -> grpc.RpcMethodHandler | None:
        details = _Details(method, metadata)

        async def base(d: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            for generic in self._generic:
                if (handler := generic.service(d)) is not None:
                    return handler
            return None

        continuation = base
        for interceptor in reversed(self._interceptors):
            continuation = _wrap(interceptor, continuation)
        return await continuation(details)

    async def _call(
        self,
        out: FrameWriter,
        key: int,
        method: str,
        request: bytes,
        timeout: float | None,
        metadata: Sequence[tuple[str, str]],
        peer: str,
        text_in_front: bool = False,
    ) -> None:
        context = RelayContext(timeout, metadata, peer)
        try:
            handler = await self._handler(method, metadata) if method in self._methods else None
            if handler is None:
                out.add(("error", key, "UNIMPLEMENTED", f"{method} is not relayed"))
                return
            message = handler.request_deserializer(request)
            if handler.response_streaming:
                stream = RelayStream(out, key, handler.response_serializer, text_in_front)
                context.relay_stream = stream
                try:
                    async for response in handler.unary_stream(message, context):
                        stream.message(response)
                finally:
                    stream.open = False
                out.add(("end", key, None))
            else:
                response = await handler.unary_unary(message, context)
                out.add(("end", key, handler.response_serializer(response)))
        except grpc.aio.AbortError:
            code = context.code() or grpc.StatusCode.UNKNOWN
            out.add(("error", key, code.name, context.details()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the error interceptor answers everything else; this is a bug
            log.error("relayed %s failed unexpectedly", method, exc_info=exc)
            out.add(("error", key, "INTERNAL", f"{type(exc).__name__}: {exc}"))


def _forget(calls: dict[int, asyncio.Task[None]], key: int, _: object) -> None:
    calls.pop(key, None)


def _wrap(interceptor: grpc.aio.ServerInterceptor, continuation: Any) -> Any:
    async def call(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return await interceptor.intercept_service(continuation, details)

    return call
