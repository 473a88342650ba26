"""A gateway in front of a worker with several front processes: with --worker-connections N it
opens N connections of its own to each worker and takes them in turn, one turn per attempt, so each
front gets some of the generations (one connection would land on one front); every completion is
whole. The turns are per worker, whatever order the router gives the workers in."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import grpc
import pytest

from loraserve.gateway.backend import Backend
from loraserve.gateway.config import GatewayConfig
from loraserve.v1 import worker_pb2, worker_pb2_grpc
from tests.helpers.gateway import ADAPTERS, openai_client, start_worker


@pytest.fixture
def two_fronts(tiny_model_dir, gateway_store):
    bg = start_worker(tiny_model_dir, gateway_store, stream_process=True, stream_processes=2)
    yield bg
    bg.stop()


def test_generations_spread_over_the_worker_s_fronts(two_fronts, start_gateway) -> None:
    gw = start_gateway(worker=two_fronts.address, worker_connections=32)
    with openai_client(gw.url) as c:
        for i in range(32):
            kw = dict(model=ADAPTERS[i % 2], prompt="Hello", max_tokens=3, temperature=0)
            if i % 2:
                chunks = list(c.completions.create(stream=True, **kw))
                text = "".join(ch.choices[0].text for ch in chunks)
                assert chunks[-1].choices[0].finish_reason == "length"
                assert text == c.completions.create(**kw).choices[0].text  # the whole one, streamed
            else:
                assert c.completions.create(**kw).usage.completion_tokens == 3
    calls = two_fronts.server.relay.calls_by_connection
    # 32 connections in turn: all on one front has odds 2 ** -31
    assert sum(calls) == 48 and min(calls) >= 1, calls


class Client:
    def __init__(self, address: str, i: int, used: list) -> None:
        self.address, self.i, self.used = address, i, used

    async def generate(self, **kw):
        self.used.append((self.address, self.i))
        return "done"


def test_each_worker_takes_its_connections_in_turn_whatever_the_router_s_order() -> None:
    backend = Backend(GatewayConfig(redis_url="redis://127.0.0.1:1", worker_connections=2))
    used: list = []
    views = [SimpleNamespace(address="a:1"), SimpleNamespace(address="b:1")]
    calls = {"n": 0}

    def candidates(adapter_id: str):  # least loaded first: the order alternates
        calls["n"] += 1
        return views if calls["n"] % 2 else views[::-1]

    backend._router = SimpleNamespace(  # type: ignore[assignment]
        candidates=candidates, routed=lambda v: contextlib.nullcontext(), note_use=lambda v, a: None
    )

    async def go() -> None:
        for a in ("a:1", "b:1"):  # the backend's own clients, each answering as a fake
            real = backend._turns(a).next()  # (opened on the loop; its turns start over below)
            turns = backend._clients[a]
            await turns.close()
            assert real in turns.clients and len(turns.clients) == 2
            turns.clients = [Client(a, i, used) for i in range(2)]  # type: ignore[list-item]
            turns._turn = 0
        for _ in range(8):
            assert await backend.generate("x") == "done"

    asyncio.run(go())
    # the first candidate serves each time: a, b, a, b, ...; each worker cycles through its clients
    assert used == [("a:1", 0), ("b:1", 0), ("a:1", 1), ("b:1", 1)] * 2


def test_worker_connections_must_be_positive() -> None:
    with pytest.raises(ValueError, match="worker_connections must be positive"):
        GatewayConfig(worker="127.0.0.1:1", worker_connections=0)


class HeldWorker(worker_pb2_grpc.InferenceWorkerServicer):
    """A worker whose generations are held until `release` is set (a stream sends one delta first)."""

    def __init__(self) -> None:
        self.started, self.release = asyncio.Event(), asyncio.Event()

    async def GetWorkerInfo(self, request, context):  # type: ignore[no-untyped-def]
        return worker_pb2.WorkerInfo()

    async def ListAdapters(self, request, context):  # type: ignore[no-untyped-def]
        return worker_pb2.ListWorkerAdaptersResponse()

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        self.started.set()
        await self.release.wait()
        return worker_pb2.GenerateResponse(text="done", adapter_id=request.adapter_id)

    async def GenerateStream(self, request, context):  # type: ignore[no-untyped-def]
        yield worker_pb2.GenerateStreamResponse(text="first")
        self.started.set()
        await self.release.wait()
        yield worker_pb2.GenerateStreamResponse(text="last")


async def serve_held() -> tuple[HeldWorker, grpc.aio.Server, str]:
    worker, server = HeldWorker(), grpc.aio.server()
    worker_pb2_grpc.add_InferenceWorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return worker, server, f"127.0.0.1:{port}"


STAYS = "127.0.0.1:1"  # (refuses connections: the router marks it down)


def departing_backend(monkeypatch, address: str) -> Backend:
    """A backend whose first discovery sees STAYS and `address`, every later one STAYS alone; its
    calls' deadline (request_timeout_s) is far longer than any test waits."""
    import loraserve.gateway.backend as backend_module

    fleets = [[STAYS, address]]
    monkeypatch.setattr(
        backend_module, "discover_workers", lambda url, prefix, **kw: fleets.pop() if fleets else [STAYS]
    )
    return Backend(GatewayConfig(redis_url="redis://127.0.0.1:1", worker_connections=2, request_timeout_s=60))


async def depart(backend: Backend) -> None:
    await backend._discover()


SHUT = grpc.ChannelConnectivity.SHUTDOWN


def test_a_departed_worker_s_idle_clients_close_at_once_the_rest_at_close(monkeypatch) -> None:
    backend = departing_backend(monkeypatch, "b:1")

    async def go() -> None:
        await backend._discover()
        a, b = backend._turns(STAYS).next(), backend._turns("b:1").next()
        await depart(backend)  # b left the fleet
        assert list(backend._clients) == [STAYS] and backend._turns(STAYS).next() is not a  # (a's next turn)
        await asyncio.wait_for(asyncio.gather(*backend._retiring), 5)  # no call runs on them
        assert b.channel.get_state() == SHUT and not backend._retiring
        await backend.close()
        assert a.channel.get_state() == SHUT and not backend._clients

    asyncio.run(go())


@pytest.mark.parametrize("streamed", [False, True], ids=["generate", "stream"])
def test_a_departed_worker_s_call_completes_then_its_clients_close_at_once(monkeypatch, streamed) -> None:
    async def go() -> None:
        worker, server, address = await serve_held()
        backend = departing_backend(monkeypatch, address)

        async def call() -> str:
            if not streamed:
                return (await backend.generate("x", prompt="Hi")).text
            return "".join([d.text async for d in backend.stream("x", prompt="Hi")])

        try:
            running = asyncio.create_task(call())
            await asyncio.wait_for(worker.started.wait(), 10)
            clients = backend._clients[address].clients
            await depart(backend)
            await asyncio.sleep(0.3)
            assert backend._retiring and not running.done()
            assert all(c.channel.get_state() != SHUT for c in clients)  # a call runs on one of them
            worker.release.set()
            assert await asyncio.wait_for(running, 10) == ("firstlast" if streamed else "done")
            await asyncio.wait_for(asyncio.gather(*backend._retiring), 5)  # not the 60 s deadline
            assert all(c.channel.get_state() == SHUT for c in clients) and not backend._retiring
        finally:
            await backend.close()
            await server.stop(None)

    asyncio.run(go())


def test_closing_the_gateway_cancels_a_departed_worker_s_calls(monkeypatch) -> None:
    async def go() -> None:
        worker, server, address = await serve_held()
        backend = departing_backend(monkeypatch, address)
        try:
            running = asyncio.create_task(backend.generate("x", prompt="Hi"))
            await asyncio.wait_for(worker.started.wait(), 10)
            clients = backend._clients[address].clients
            await depart(backend)
            await asyncio.sleep(0.1)
            assert backend._retiring and not running.done()
            await asyncio.wait_for(backend.close(), 5)  # not the 60 s deadline
            assert not backend._retiring and all(c.channel.get_state() == SHUT for c in clients)
            with pytest.raises(asyncio.CancelledError):  # (grpc.aio's end of a call cancelled here)
                await asyncio.wait_for(running, 5)
        finally:
            await server.stop(None)

    asyncio.run(go())
