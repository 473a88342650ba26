"""A Redis that runs the store's write and answers after the client's socket timeout (a stall of an
fsync or a fork): redis-py sends the script again, and the write answers as it did the first time
(not ALREADY_EXISTS for its own registration, nor NOT_FOUND for its own delete). A delete that
cannot reach Redis still drops the store's copies of the adapter."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from loraserve.adapter_store.registry_redis import RedisRegistry
from loraserve.clients.adapter_fetch import fetch_adapter
from loraserve.v1 import store_pb2, store_pb2_grpc
from tests.adapter_store.test_registry import _record
from tests.helpers.store_calls import register

pytestmark = pytest.mark.redis


class ReplyDroppingProxy:
    """TCP between a client and Redis on 127.0.0.1:0. `drop_next_reply()`: the next bytes Redis
    answers, and everything after them on that connection, never reach the client, as if Redis
    ran the command and stalled past the client's timeout. `cut()`: Redis unreachable."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}"
        self._drop = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_next_reply(self) -> None:
        self._drop.set()

    def cut(self) -> None:
        with self._lock:
            for s in [self.listener, *self._socks]:
                try:
                    s.shutdown(socket.SHUT_RDWR)  # wakes the threads blocked on them; close would not
                except OSError:
                    pass
                s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self._lock:
                self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        muted = False
        try:
            while data := src.recv(65536):
                if replies and not muted and self._drop.is_set():
                    self._drop.clear()
                    muted = True
                if not muted:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture
def proxy(redis_url: str) -> Iterator[ReplyDroppingProxy]:
    import redis

    kwargs = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs
    p = ReplyDroppingProxy((kwargs.get("host", "127.0.0.1"), kwargs.get("port", 6379)))
    yield p
    p.cut()


def test_a_write_whose_reply_is_lost_answers_as_it_ran(
    proxy: ReplyDroppingProxy, redis_url: str, redis_prefix: str
) -> None:
    import redis

    db = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs.get("db", 0)
    reg = RedisRegistry(f"{proxy.url}/{db}", redis_prefix)
    reg.put(_record("warm", "0" * 64), overwrite=False)  # the scripts are loaded: the next
    reg.delete("warm")  # dropped replies are of writes that ran
    try:
        proxy.drop_next_reply()
        assert reg.put(_record("x", "d" * 64), overwrite=False) is None
        proxy.drop_next_reply()
        old = reg.put(_record("x", "e" * 64), overwrite=True)
        assert old is not None and old.digest == "d" * 64
        proxy.drop_next_reply()
        deleted = reg.delete("x")
        assert deleted is not None and deleted.digest == "e" * 64
    finally:
        reg.close()
    direct = redis.Redis.from_url(redis_url, decode_responses=True)
    events = [fields for _, fields in direct.xrange(f"{redis_prefix}events")]
    assert [e["event"] for e in events if e["adapter_id"] == "x"] == ["replaced", "deleted"]  # once each
    direct.close()


def test_a_delete_that_cannot_reach_redis_drops_the_cpu_copy(
    start_store, proxy: ReplyDroppingProxy, redis_url: str, redis_prefix: str
) -> None:
    """The registry may have deleted the record and lost the reply: the CPU cache's copy goes
    anyway, so the payload is not served under its last known record while the registry is
    unreachable (the disk tier is not read then, and its copy, of an adapter perhaps still
    registered, stays)."""
    import redis

    db = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs.get("db", 0)
    store = start_store(redis_url=f"{proxy.url}/{db}", redis_prefix=redis_prefix)
    tier = store.service.tier
    assert tier is not None
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        register(stub, "x", "peft-qv-r8")
        fetch_adapter(stub, "x")
        assert any(p.name.startswith("x@") for p in tier.directory.iterdir())
        proxy.cut()
        with pytest.raises(grpc.RpcError) as err:
            stub.DeleteAdapter(store_pb2.DeleteAdapterRequest(adapter_id="x"), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "x" not in store.service.cache
        time.sleep(0.2)  # (the tier would remove a file on its writer thread)
        assert any(p.name.startswith("x@") for p in tier.directory.iterdir())
        with pytest.raises(grpc.RpcError) as err:
            fetch_adapter(stub, "x")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
