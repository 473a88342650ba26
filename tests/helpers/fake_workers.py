"""Stand-ins for inference workers, for the clients' tests of routing, deadlines and keepalive: a
`FakeWorker` servicer on a real grpc.aio server (the services' own `grpc_server`, so their
keepalive policy too; port 0, its own loop in a thread) that reports a load and the adapters it
holds and answers generations with its address, and can hang; a `silent_listener`, which accepts
connections and never says a word (not even HTTP/2's preface); and a `FreezingProxy`, a peer that
goes silent with its connections open."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from loraserve.serving.background import BackgroundServer
from loraserve.serving.ports import grpc_server
from loraserve.v1 import worker_pb2, worker_pb2_grpc


class FakeWorker(worker_pb2_grpc.InferenceWorkerServicer):
    """`hung`: every call waits until it is cleared (or the call is cancelled); `hung_generations`:
    only Generate and GenerateStream do. A stream sends `stream_messages` messages `stream_gap_s`
    apart, the first after `first_message_s`."""

    def __init__(self, gpu: set[str] | None = None, load: int = 0) -> None:
        self.gpu, self.load = set(gpu or ()), load
        self.hung = self.hung_generations = False
        self.first_message_s, self.stream_gap_s, self.stream_messages = 0.0, 0.0, 2
        self.calls: list[str] = []
        self.cancelled = 0  # calls cancelled by their client while held
        self.address = ""  # its server's, once served

    async def _hold(self, generation: bool = False) -> None:
        try:
            while self.hung or (generation and self.hung_generations):
                await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def GetWorkerInfo(self, request: Any, context: Any) -> worker_pb2.WorkerInfo:
        self.calls.append("GetWorkerInfo")
        await self._hold()
        return worker_pb2.WorkerInfo(num_running=self.load, max_loras=4)

    async def ListAdapters(self, request: Any, context: Any) -> worker_pb2.ListWorkerAdaptersResponse:
        self.calls.append("ListAdapters")
        await self._hold()
        return worker_pb2.ListWorkerAdaptersResponse(
            adapters=[
                worker_pb2.WorkerAdapter(adapter_id=a, tier=worker_pb2.ADAPTER_TIER_GPU) for a in self.gpu
            ]
        )

    async def Generate(self, request: Any, context: Any) -> worker_pb2.GenerateResponse:
        self.calls.append("Generate")
        await self._hold(generation=True)
        return worker_pb2.GenerateResponse(text=self.address, adapter_id=request.adapter_id)

    async def GenerateStream(
        self, request: Any, context: Any
    ) -> AsyncIterator[worker_pb2.GenerateStreamResponse]:
        self.calls.append("GenerateStream")
        await self._hold(generation=True)
        await asyncio.sleep(self.first_message_s)
        for i in range(self.stream_messages):
            if i:
                await asyncio.sleep(self.stream_gap_s)
            yield worker_pb2.GenerateStreamResponse(text=self.address, token_ids=[i])


class FakeWorkerServer(BackgroundServer[Any]):
    def __init__(self, worker: FakeWorker) -> None:
        async def start() -> tuple[Any, int]:
            server = grpc_server()
            worker_pb2_grpc.add_InferenceWorkerServicer_to_server(worker, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, port

        super().__init__(start, "127.0.0.1", "fake-worker")
        self.worker = worker
        worker.address = self.address

    def stop(self) -> None:
        self.worker.hung = self.worker.hung_generations = False
        self._shutdown(self.server.stop(0), 5.0)


@contextmanager
def fake_workers(*workers: FakeWorker) -> Iterator[list[str]]:
    """The workers served, each on a port of its own; -> their addresses."""
    served: list[FakeWorkerServer] = []
    try:
        for w in workers:
            served.append(FakeWorkerServer(w))
        yield [s.address for s in served]
    finally:
        for s in served:
            s.stop()


@contextmanager
def silent_listener() -> Iterator[str]:
    """host:port of a socket that takes connections (the kernel completes them) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


class FreezingProxy:
    """A TCP proxy to `target` that can freeze: it then passes nothing on, either way, and keeps
    every connection open, which is how a peer looks whose host went away or whose process was
    stopped (SIGSTOP)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self.frozen = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="freezing-proxy", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self._target)
            except OSError:
                return
            self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            while self.frozen.is_set():  # read, never passed on: a ping goes unanswered
                time.sleep(0.02)
            try:
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.frozen.clear()
        self._listener.close()
        for s in self._sockets:
            s.close()
