"""What a benchmark drives: one worker, the router across a fleet, or an OpenAI-compatible HTTP
endpoint. Each target streams one BenchRequest as `Chunk`s (the runner times them) and turns its
transport's failures into a `TargetError` whose status names the code (a gRPC status, `HTTP 429`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import grpc

from loraserve.clients.bench.workload import BenchRequest
from loraserve.clients.router import WorkerRouter
from loraserve.clients.worker_client import AsyncWorkerClient, ClientTurns
from loraserve.contract.streaming import MAX_STREAM_INTERVAL
from loraserve.v1 import worker_pb2


class Chunk(NamedTuple):  # (a tuple: one is made for every message of every stream)
    tokens: int  # output tokens in this chunk
    prompt_tokens: int | None = None  # set on the last chunk when the server reports usage
    completion_tokens: int | None = None
    worker: str = ""  # which worker served it (router target)
    adapter_tier: str = ""  # where the worker found the adapter: gpu, cpu, store ("" unknown)
    engine_ms: float | None = None  # the worker's own time for the request (its engine's arrival to end)


class TargetError(Exception):
    def __init__(self, status: str, message: str = "") -> None:
        super().__init__(f"{status}: {message}" if message else status)
        self.status, self.message = status, message


class Target(Protocol):
    description: str

    async def start(self) -> None: ...

    def stream(self, request: BenchRequest) -> AsyncIterator[Chunk]: ...

    async def vocab_size(self) -> int | None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    ignore_eos: bool = True  # generate exactly max_tokens, so output lengths are what was asked
    timeout_s: float | None = None
    # a worker's stream: its tokens this many to a message, the first alone (GenerateRequest's
    # stream_interval); 0 = the worker's default (one a message unless its --stream-interval)
    stream_interval: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(
                f"stream interval must be in [0, {MAX_STREAM_INTERVAL}], got {self.stream_interval}"
            )

    @property
    def stream_note(self) -> str:
        """How the streams are asked for, for a target's description ("" for the worker's default)."""
        k = self.stream_interval
        return f", tokens {k} to a message" if k > 1 else ", a message per token" if k == 1 else ""


def _open(client: AsyncWorkerClient, request: BenchRequest, s: Sampling) -> grpc.aio.UnaryStreamCall:
    """The worker's stream for one benchmark request, its messages read raw (no Delta, no text: the
    generator's own cost a message limits the rate it can drive); the caller cancels it."""
    return client.open_stream(
        request.prompt,
        adapter_id=request.adapter_id,
        max_tokens=request.max_tokens,
        temperature=s.temperature,
        ignore_eos=s.ignore_eos,
        stream_interval=s.stream_interval,
        timeout=s.timeout_s,
    )


def _chunk(r: worker_pb2.GenerateStreamResponse, worker: str) -> Chunk:
    if not r.HasField("usage"):  # (all but the stream's last message)
        return Chunk(len(r.token_ids), worker=worker)
    u = r.usage
    return Chunk(
        len(r.token_ids),
        u.prompt_tokens,
        u.completion_tokens,
        worker,
        u.adapter_tier,
        u.total_time_ms or None,
    )


def _rpc_error(exc: grpc.aio.AioRpcError) -> TargetError:
    return TargetError(exc.code().name, exc.details() or "")


CONNECT_S = 10.0  # for a target's further connections, once its first has answered


class WorkerTarget:
    """One worker over gRPC (GenerateStream), over `connections` connections of its own taken in
    turn (a worker with several front processes gets each connection on one of them)."""

    def __init__(
        self,
        address: str,
        sampling: Sampling,
        *,
        token: str | None = None,
        tls_ca=None,
        tls: bool = False,
        connections: int = 1,
    ) -> None:
        self.address, self.sampling = address, sampling
        self.turns = ClientTurns(address, connections, token=token, tls_ca=tls_ca, tls=tls)
        self.description = (
            f"worker {address}"
            + (f" over {connections} connections" if connections > 1 else "")
            + sampling.stream_note
        )
        self.client = self.turns.clients[0]

    async def start(self) -> None:
        try:
            await self.client.info()
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error(exc) from None
        # the other connections too, so no request of the run pays for opening one
        others = [c.channel.channel_ready() for c in self.turns.clients[1:]]
        try:
            await asyncio.wait_for(asyncio.gather(*others), CONNECT_S)
        except asyncio.TimeoutError:
            raise TargetError(
                "UNAVAILABLE", f"not all {len(self.turns.clients)} connections opened"
            ) from None

    async def vocab_size(self) -> int | None:
        return int((await self.client.info()).vocab_size) or None

    async def stream(self, request: BenchRequest) -> AsyncIterator[Chunk]:
        call = _open(self.turns.next(), request, self.sampling)
        try:
            async for r in call:
                yield _chunk(r, self.address)
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error(exc) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        await self.turns.close()


class RouterTarget:
    """A fleet through the router's choice (adapter residency, load); the streams run on asyncio
    clients, one per worker. A worker answering UNAVAILABLE before its first token is marked down
    and the request tried on the next candidate, as the router does."""

    def __init__(
        self,
        addresses: Sequence[str],
        sampling: Sampling,
        *,
        token: str | None = None,
        tls_ca=None,
        tls: bool = False,
        connections: int = 1,
    ) -> None:
        if connections < 1:  # (before the router opens its channels)
            raise ValueError("connections must be >= 1")
        self.sampling = sampling
        self.router = WorkerRouter(addresses, token=token, tls_ca=tls_ca, tls=tls)
        self.turns = {
            w.address: ClientTurns(w.address, connections, token=token, tls_ca=tls_ca, tls=tls)
            for w in self.router.workers
        }
        self.description = (
            f"router over {len(self.turns)} worker(s)"
            + (f", {connections} connections each" if connections > 1 else "")
            + sampling.stream_note
        )

    async def start(self) -> None:
        await asyncio.to_thread(self.router.candidates)

    async def vocab_size(self) -> int | None:
        for turns in self.turns.values():
            try:
                return int((await turns.clients[0].info()).vocab_size) or None
            except grpc.aio.AioRpcError:
                continue
        return None

    async def stream(self, request: BenchRequest) -> AsyncIterator[Chunk]:
        s = self.sampling
        # candidates() refreshes residency over blocking RPCs every refresh_s: off the loop
        candidates = await asyncio.to_thread(self.router.candidates, request.adapter_id)
        last: grpc.aio.AioRpcError | None = None
        for w in candidates:
            started = False
            try:
                with self.router.routed(w):
                    call = _open(self.turns[w.address].next(), request, s)
                    try:
                        async for r in call:
                            started = True
                            yield _chunk(r, w.address)
                    finally:
                        call.cancel()
            except grpc.aio.AioRpcError as exc:
                if started or exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise _rpc_error(exc) from None
                self.router.mark_down(w)
                last = exc
                continue
            self.router.note_use(w, request.adapter_id)
            return
        assert last is not None
        raise _rpc_error(last)

    async def close(self) -> None:
        for turns in self.turns.values():
            await turns.close()
        self.router.close()
