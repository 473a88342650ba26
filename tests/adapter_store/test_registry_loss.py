"""Redis loses the registry (restarted with no persistence, or flushed) under a store whose
registry is there: the store restores it from its copy in the data directory, so nothing reads as
deleted — not its listing, not its disk tier's start-up sweep — and a deletion is still honoured,
then and after another loss. A private redis-server with no persistence: a restart empties it."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from loraserve.adapter_store.server import BackgroundStore
from loraserve.clients.adapter_fetch import fetch_adapter
from loraserve.v1 import store_pb2, store_pb2_grpc
from tests.helpers.private_redis import PrivateRedis
from tests.helpers.store_calls import expect_error, register

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server binary"),
]
PREFIX = "loraserve-loss:"
NO_PERSISTENCE = ("--save", "", "--appendonly", "no")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[PrivateRedis]:
    (tmp_path / "redis").mkdir()
    server = PrivateRedis(tmp_path / "redis", NO_PERSISTENCE)
    server.start()
    yield server
    server.stop()


def _restart_empty(server: PrivateRedis) -> None:
    server.stop()
    server.start()
    import redis

    assert redis.Redis.from_url(server.url).dbsize() == 0


def _listed(address: str) -> list[str]:
    with grpc.insecure_channel(address) as ch:
        reply = store_pb2_grpc.AdapterStoreStub(ch).ListAdapters(store_pb2.ListAdaptersRequest())
        return [a.adapter_id for a in reply.adapters]


def _payload_files(store: BackgroundStore) -> set[str]:
    tier = store.service.tier
    assert tier is not None
    tier.flush()
    return {p.name.partition("@")[0] for p in tier.directory.glob("*.payload")}


def test_a_registry_redis_lost_is_restored_not_deleted(
    start_store: Callable[..., BackgroundStore], redis_server: PrivateRedis
) -> None:
    store = start_store(redis_url=redis_server.url, redis_prefix=PREFIX)
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        infos = {n: register(stub, n, n) for n in ("peft-qv-r8", "peft-patterns")}
    assert _payload_files(store) == set(infos)

    _restart_empty(redis_server)
    assert _listed(store.address) == sorted(infos)  # restored before it answered
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        for name, info in infos.items():
            assert stub.GetAdapter(store_pb2.GetAdapterRequest(adapter_id=name)) == info
            assert fetch_adapter(stub, name).digest == info.digest

    # lost while the store is down: its disk tier's start-up sweep keeps every payload
    store.stop()
    _restart_empty(redis_server)
    store = start_store(redis_url=redis_server.url, redis_prefix=PREFIX)
    assert _listed(store.address) == sorted(infos)
    assert _payload_files(store) == set(infos)


def test_a_deletion_is_honoured_across_a_loss(
    start_store: Callable[..., BackgroundStore], redis_server: PrivateRedis
) -> None:
    store = start_store(redis_url=redis_server.url, redis_prefix=PREFIX)
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        for n in ("peft-qv-r8", "peft-patterns", "peft-subset-layer1"):
            register(stub, n, n)
        stub.DeleteAdapter(store_pb2.DeleteAdapterRequest(adapter_id="peft-qv-r8"))
        _restart_empty(redis_server)
        # the first call after the loss is a deletion: honoured, on the restored registry
        stub.DeleteAdapter(store_pb2.DeleteAdapterRequest(adapter_id="peft-patterns"))
        expect_error(
            lambda: stub.DeleteAdapter(store_pb2.DeleteAdapterRequest(adapter_id="peft-qv-r8")),
            grpc.StatusCode.NOT_FOUND,
            "'peft-qv-r8' is not registered",
        )
    assert _listed(store.address) == ["peft-subset-layer1"]
    assert _payload_files(store) == {"peft-subset-layer1"}

    _restart_empty(redis_server)  # what was deleted stays deleted
    assert _listed(store.address) == ["peft-subset-layer1"]
    store.stop()
    store = start_store(redis_url=redis_server.url, redis_prefix=PREFIX)
    assert _listed(store.address) == ["peft-subset-layer1"]
    assert _payload_files(store) == {"peft-subset-layer1"}
