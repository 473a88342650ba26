"""The store clients' HTTP/2 keepalive, the worker clients' own (`channel.KEEPALIVE`): on the
channels the clients open, accepted by the store's server (made by the services' `grpc_server`)
on an idle connection, and ending a call to a store gone silent with its connection open."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest

from loraserve.clients.channel import KEEPALIVE, MIN_KEEPALIVE_S, Keepalive
from loraserve.clients.store_client import AsyncStoreClient, StoreClient
from tests.helpers.fake_workers import FreezingProxy

pytestmark = pytest.mark.timeout(60)
QUICK = Keepalive(interval_s=MIN_KEEPALIVE_S, timeout_s=1.0)  # a ping every 2 s: the fastest allowed
KEEPALIVE_KEYS = {name for name, _ in KEEPALIVE.options()}


def _opened(monkeypatch, module, name: str) -> list[dict]:
    """The options of every channel `module.name` (grpc's channel constructor) opens from now on."""
    real: Callable = getattr(module, name)
    seen: list[dict] = []

    def spy(*args, options=(), **kw):
        seen.append(dict(options or ()))
        return real(*args, options=options, **kw)

    monkeypatch.setattr(module, name, spy)
    return seen


def test_the_store_clients_channels_carry_the_keepalive(monkeypatch) -> None:
    sync_opened = _opened(monkeypatch, grpc, "insecure_channel")
    aio_opened = _opened(monkeypatch, grpc.aio, "insecure_channel")
    StoreClient("127.0.0.1:1").close()
    StoreClient("127.0.0.1:1", keepalive=None).close()

    async def go() -> None:
        await AsyncStoreClient("127.0.0.1:1").close()

    asyncio.run(go())
    with_keepalive, without = sync_opened
    assert with_keepalive.items() >= dict(KEEPALIVE.options()).items()
    assert with_keepalive["grpc.http2.lookahead_bytes"] == 8 << 20  # the store's own options stay
    assert not KEEPALIVE_KEYS & set(without)
    (aio,) = aio_opened
    assert aio.items() >= dict(KEEPALIVE.options()).items()


@pytest.mark.slow
def test_the_store_accepts_the_pings_of_an_idle_connection(store) -> None:
    """Over 7 s without a call the connection sends 3 pings (gRPC's defaults answer the third with
    GOAWAY, too_many_pings); it is never closed and serves the next call."""
    with StoreClient(store.address, keepalive=QUICK, timeout=10) as client:
        assert list(client.list()) == []
        states: list[grpc.ChannelConnectivity] = []
        client.channel.subscribe(states.append)
        try:
            time.sleep(7.0)
            assert list(client.list()) == []
        finally:
            client.channel.unsubscribe(states.append)
        assert set(states) == {grpc.ChannelConnectivity.READY}, states


def test_a_store_gone_silent_ends_a_call_within_the_keepalive(store) -> None:
    """The store stops answering with its connection open: a call with a long deadline ends
    UNAVAILABLE within the keepalive's interval and timeout, in either client."""
    bound = QUICK.interval_s + QUICK.timeout_s + 2.0

    proxy = FreezingProxy(store.address)
    try:
        with StoreClient(proxy.address, keepalive=QUICK, timeout=30) as client:
            assert list(client.list()) == []
            proxy.frozen.set()
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                list(client.list())
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - t0 < bound
    finally:
        proxy.close()

    async def go() -> None:
        async with AsyncStoreClient(proxy.address, keepalive=QUICK, timeout=30) as client:
            assert [a async for a in client.list()] == []
            proxy.frozen.set()
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                await client.get("any")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
            assert time.monotonic() - t0 < bound

    proxy = FreezingProxy(store.address)
    try:
        asyncio.run(go())
    finally:
        proxy.close()
