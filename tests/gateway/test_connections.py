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
    backend._discovered_at = float("inf")  # (no Redis read)

    async def go() -> None:
        for a in ("a:1", "b:1"):  # the backend's own clients, each answering as a fake
            real = backend.client(a)  # (opened on the loop; its turns start over below)
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


def test_a_departed_worker_s_clients_close_once_their_calls_are_over(monkeypatch) -> None:
    import loraserve.gateway.backend as backend_module

    fleets = [["a:1", "b:1"], ["a:1"]]
    monkeypatch.setattr(backend_module, "discover_workers", lambda url, prefix: fleets.pop(0))
    backend = Backend(
        GatewayConfig(redis_url="redis://127.0.0.1:1", worker_connections=2, request_timeout_s=0.2)
    )

    async def go() -> None:
        await backend._discover()
        a, b = backend.client("a:1"), backend.client("b:1")
        backend._discovered_at = float("-inf")
        await backend._discover()  # b left the fleet
        assert list(backend._clients) == ["a:1"] and backend.client("a:1") is not a  # (a's next turn)
        shut = grpc.ChannelConnectivity.SHUTDOWN
        assert b.channel.get_state() != shut  # a call on it may still run
        await asyncio.sleep(0.4)
        assert b.channel.get_state() == shut and not backend._retiring
        await backend.close()
        assert a.channel.get_state() == shut and not backend._clients

    asyncio.run(go())
