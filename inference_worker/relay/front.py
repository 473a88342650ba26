"""The front process of the stream relay: `python -m loraserve.inference_worker.relay.front --host H
--port P --core 127.0.0.1:Q --socket PATH [--tls-cert C --tls-key K] [--share-port [--joining]]`,
started by the worker (one or several: with --share-port they all listen on one port, the first
binding it and the others joining, and the kernel spreads the clients' connections over them).

It serves the worker's public address. Generate and GenerateStream go to the worker over its relay
socket (framing.py) and their messages come back a step's worth at a time (consecutive running
outputs of a completion that queued while the front was busy leave as one message, as in the
worker's own loop); every other call (the
admin RPCs, health, reflection) passes through to the worker's gRPC server on its private port,
metadata included, so tokens and statuses are the worker's own. It prints `listening PORT` (or
`error MESSAGE`) on stdout once, then logs on stderr, and exits when the worker's socket or its
stdin (the worker's end of the pipe) closes; it ignores SIGINT and SIGTERM, which are the worker's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
from tokenizers import Tokenizer

from loraserve.inference_worker.relay.deltas import delta_message, mergeable, merged_run
from loraserve.inference_worker.relay.framing import FrameWriter, read_frame
from loraserve.inference_worker.relay.front_text import StreamText, text_in_front
from loraserve.inference_worker.run_reader import RunReader

SERVICE = "/loraserve.v1.InferenceWorker/"
RELAYED = {SERVICE + "GenerateStream": True, SERVICE + "Generate": False}  # -> response streaming
CLOSE_GRACE_S = 2.0
PASSED = {
    **{SERVICE + m: "unary_unary" for m in ("LoadAdapter", "UnloadAdapter", "PinAdapter", "ListAdapters")},
    SERVICE + "GetWorkerInfo": "unary_unary",
    "/grpc.health.v1.Health/Check": "unary_unary",
    "/grpc.health.v1.Health/Watch": "unary_stream",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": "stream_stream",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": "stream_stream",
}


def _metadata(context: grpc.aio.ServicerContext) -> list[tuple[str, Any]]:
    """The caller's metadata to pass on (not transport headers)."""
    return [
        (k, v)
        for k, v in (context.invocation_metadata() or ())
        if not k.startswith((":", "grpc-")) and k != "user-agent"
    ]


def tokenizer_from_json(text: str) -> Tokenizer | None:
    """The worker's tokenizer; None (the worker then makes all text) when it does not load here."""
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:
        print(
            f"the worker's tokenizer did not load ({exc}); the worker makes the text",
            file=sys.stderr,
            flush=True,
        )
        return None


def _deltas_follow(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether the operation `b` merges into `a`: deltas, `b` continuing `a`'s completion (the
    worker's own messages and statuses never merge)."""
    return a[0] == "delta" and b[0] == "delta" and mergeable(a[2], b[2])


def _merged_deltas(run: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    return ("delta", run[0][1], merged_run([op[2] for op in run]))


class Link:
    """The connection to the worker's relay socket; each relayed call reads its own queue."""

    def __init__(self) -> None:
        self.out: FrameWriter | None = None
        self.tokenizer: Tokenizer | None = None  # the worker's, sent first: the text of its streams
        self.calls: dict[int, asyncio.Queue[tuple[Any, ...]]] = {}
        self.closed = asyncio.Event()
        self._next = 0

    async def connect(self, path: str) -> None:
        """Once the worker listens on `path` (it loads its model first)."""
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(path)
                break
            except OSError:
                await asyncio.sleep(0.05)
        self.out = FrameWriter(writer)
        asyncio.ensure_future(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while (ops := await read_frame(reader)) is not None:
                for op in ops:
                    if op[0] == "tokenizer":
                        self.tokenizer = tokenizer_from_json(op[2])
                    elif (queue := self.calls.get(op[1])) is not None:
                        queue.put_nowait(op)
        except ConnectionError as exc:
            print(f"relay connection closed: {exc}", file=sys.stderr, flush=True)
        self.out = None
        for key, queue in self.calls.items():
            queue.put_nowait(("error", key, "UNAVAILABLE", "the worker stopped"))
        self.closed.set()

    def call(
        self, method: str, request: bytes, context: grpc.aio.ServicerContext, text_here: bool = False
    ) -> tuple[int, asyncio.Queue]:
        key, self._next = self._next, self._next + 1
        queue: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self.calls[key] = queue
        if self.out is None:
            queue.put_nowait(("error", key, "UNAVAILABLE", "the worker is not serving yet"))
        else:
            op = (
                "call",
                key,
                method,
                request,
                context.time_remaining(),
                _metadata(context),
                context.peer(),
                text_here,
            )
            self.out.add(op)
        return key, queue

    def done(self, key: int, cancel: bool) -> None:
        self.calls.pop(key, None)
        if cancel and self.out is not None:
            self.out.add(("cancel", key))


class Front(grpc.GenericRpcHandler):
    def __init__(self, link: Link, core: grpc.aio.Channel) -> None:
        self.link, self.core = link, core

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        if method in RELAYED:
            if RELAYED[method]:
                return grpc.unary_stream_rpc_method_handler(self._relay_stream(method))
            return grpc.unary_unary_rpc_method_handler(self._relay_unary(method))
        kind = PASSED.get(method)
        if kind == "unary_unary":
            return grpc.unary_unary_rpc_method_handler(self._pass_unary(method))
        if kind == "unary_stream":
            return grpc.unary_stream_rpc_method_handler(self._pass_streamed(self.core.unary_stream(method)))
        if kind == "stream_stream":
            return grpc.stream_stream_rpc_method_handler(self._pass_streamed(self.core.stream_stream(method)))
        return None

    # ------------------------------------------------------------------- relayed generations
    def _relay_stream(self, method: str) -> Any:
        async def behavior(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            tokenizer = self.link.tokenizer
            text = StreamText(tokenizer) if tokenizer is not None and text_in_front(request) else None
            key, queue = self.link.call(method, request, context, text_here=text is not None)
            reader = RunReader(queue, _deltas_follow, _merged_deltas)
            ended = False
            try:
                while True:
                    # deltas of one completion that queued behind it while this process was busy
                    # come as one: a front that falls behind sends fewer, larger messages
                    op = await reader.next()
                    if op[0] == "delta":
                        yield delta_message(op[2]) if text is None else text.delta(op[2])
                        continue
                    if op[0] == "message":
                        yield op[2] if text is None else text.message(op[2])
                        continue
                    ended = True
                    if op[0] == "error":
                        await context.abort(grpc.StatusCode[op[2]], op[3])
                    return
            finally:
                self.link.done(key, cancel=not ended)

        return behavior

    def _relay_unary(self, method: str) -> Any:
        async def behavior(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            key, queue = self.link.call(method, request, context)
            ended = False
            try:
                op = await queue.get()
                ended = True
                if op[0] == "end":
                    return bytes(op[2])
                await context.abort(grpc.StatusCode[op[2]], op[3])
                raise AssertionError("abort returned")
            finally:
                self.link.done(key, cancel=not ended)

        return behavior

    # ------------------------------------------------------------------- passed-through calls
    def _pass_unary(self, method: str) -> Any:
        call = self.core.unary_unary(method)

        async def behavior(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                return await call(request, timeout=context.time_remaining(), metadata=_metadata(context))
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")
                raise AssertionError("abort returned") from None

        return behavior

    @staticmethod
    def _pass_streamed(call: Any) -> Any:
        """A response stream passed through; `call`: the worker's unary-stream or stream-stream
        method, given the request or the caller's request stream."""

        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            try:
                async for response in call(
                    request, timeout=context.time_remaining(), metadata=_metadata(context)
                ):
                    yield response
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")

        return behavior


async def serve(args: argparse.Namespace) -> int:
    from loraserve.serving.gc_tuning import PYTHON_GEN0_THRESHOLD, tune_gc
    from loraserve.serving.ports import PortUnavailable, bind_grpc_port, grpc_server

    link = Link()
    core = grpc.aio.insecure_channel(args.core, options=[("grpc.max_receive_message_length", 64 << 20)])
    server = grpc_server(options=[("grpc.max_receive_message_length", 4 << 20)], share_port=args.share_port)
    server.add_generic_rpc_handlers((Front(link, core),))
    try:
        port = bind_grpc_port(server, args.host, args.port, args.tls_cert, args.tls_key, joining=args.joining)
    except PortUnavailable as exc:
        print(f"error {exc}", flush=True)
        return 1
    await server.start()
    # what start-up made is never collected again (each call leaves a small cycle in gRPC's
    # dispatch, so collections run; frozen, they no longer walk the modules): at most ~0.4 ms
    tune_gc(PYTHON_GEN0_THRESHOLD)
    print(f"listening {port}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    # the worker holds our stdin open while it lives: its end (however the worker ended, or its
    # closing the pipe to stop us) is ours
    loop.add_reader(0, _on_stdin, stop)
    connect = asyncio.ensure_future(link.connect(args.socket))
    closed = asyncio.ensure_future(link.closed.wait())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({closed, stopped}, return_when=asyncio.FIRST_COMPLETED)
    connect.cancel()
    # The worker closed the socket (it stops): every relayed call has its last operation queued
    # (the worker's status, else "the worker stopped"), so a short grace lets them all send it.
    # Stopped by the worker (its pipe closed) or its death instead: at once.
    await server.stop(CLOSE_GRACE_S if closed.done() and not stopped.done() else 0)
    await core.close()
    return 0


def _on_stdin(stop: asyncio.Event) -> None:
    try:
        data = os.read(0, 4096)
    except OSError:
        data = b""
    if not data:
        asyncio.get_running_loop().remove_reader(0)
        stop.set()


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C and a SIGTERM to the whole process group (`kill -- -PGID`, `timeout`) are the worker's
    # to act on: it drains, then ends this process through the pipe, after its calls are finished
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    p = argparse.ArgumentParser(prog="loraserve-worker-front")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--core", required=True, help="the worker's private gRPC address")
    p.add_argument("--socket", required=True, help="the worker's relay socket")
    p.add_argument("--tls-cert", default=None)
    p.add_argument("--tls-key", default=None)
    p.add_argument("--share-port", action="store_true", help="one of several fronts on the port")
    p.add_argument("--joining", action="store_true", help="with --share-port: the port is bound already")
    args = p.parse_args(argv)
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
