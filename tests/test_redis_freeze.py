"""A hung Redis (SIGSTOP: connections open, nothing answered) under a running store and worker:
base-model requests and requests for a resident adapter keep their latency, since the engine's
step loop never waits on the network; after SIGCONT the worker's residency is republished as it
is now and an invalidation issued by the store is applied."""

from __future__ import annotations

import concurrent.futures
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraserve.adapter_store.demo import DEMO_ADAPTERS
from loraserve.adapter_store.server import BackgroundStore
from loraserve.clients.store_client import StoreClient
from loraserve.clients.worker_client import WorkerClient
from loraserve.inference_worker.server import BackgroundWorker
from tests.helpers.private_redis import PrivateRedis
from tests.helpers.redis_system import assert_soon, redis_system

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server binary"),
]
PROMPT = [7, 21, 63, 189, 11]
PREFIX = "loraserve-freeze:"
ROUNDS = 6


@pytest.fixture
def system(
    tiny_model_dir: Path, tmp_path: Path
) -> Iterator[tuple[PrivateRedis, BackgroundStore, BackgroundWorker]]:
    with redis_system(
        tiny_model_dir,
        tmp_path,
        prefix=PREFIX,
        worker_id="w-freeze",
        adapter_poll_interval_s=0.2,
        worker_log_level="ERROR",
    ) as running:
        yield running


def latencies(address: str, adapter_id: str, min_s: float = 0.0) -> tuple[list[float], list[float]]:
    """Seconds of base and `adapter_id` requests, sent in concurrent pairs (mixed batches), for
    ROUNDS pairs and at least `min_s` seconds."""
    base, adapter = [], []
    end = time.monotonic() + min_s
    with WorkerClient(address, timeout=60) as w, concurrent.futures.ThreadPoolExecutor(2) as pool:

        def timed(aid: str) -> float:
            t0 = time.monotonic()
            w.generate(PROMPT, adapter_id=aid, max_tokens=6)
            return time.monotonic() - t0

        while len(base) < ROUNDS or time.monotonic() < end:
            b, a = pool.submit(timed, ""), pool.submit(timed, adapter_id)
            base.append(b.result())
            adapter.append(a.result())
    return base, adapter


def test_a_frozen_redis_costs_staleness_not_latency(system) -> None:
    import redis

    server, store, worker = system
    resident, dropped, other = (s.name for s in DEMO_ADAPTERS)
    with StoreClient(store.address) as s:
        old = s.register(resident, resident)
        s.register(dropped, dropped)
    with WorkerClient(worker.address, timeout=60) as w:
        w.load_adapter(resident, "gpu")
        w.load_adapter(dropped, "cpu")
    r = redis.Redis.from_url(server.url, decode_responses=True)
    residency = PREFIX + "residency:w-freeze"
    assert_soon(lambda: set(r.hkeys(residency)) == {resident, dropped}, what="residency published")
    latencies(worker.address, resident)  # warm up
    normal = latencies(worker.address, resident)

    server.freeze()
    try:
        time.sleep(0.5)  # the worker's coordination thread is now stuck on Redis
        # traffic for longer than one round of the Redis client's timeout, retry and back-off
        frozen = latencies(worker.address, resident, min_s=3.0)
        with WorkerClient(worker.address, timeout=60) as w:
            assert w.unload_adapter(dropped)  # a residency change Redis cannot hear of yet
    finally:
        server.thaw()
    for kind, before, during in zip(("base", "adapter"), normal, frozen, strict=True):
        # generous floors: a loaded 2-core machine jitters by tens of milliseconds; any wait on
        # Redis costs at least its 1 s socket timeout
        typical = statistics.median(before)
        assert statistics.median(during) <= max(2 * typical, typical + 0.25), (kind, before, during)
        assert max(during) <= typical + 0.75, (kind, before, during)

    assert_soon(lambda: set(r.hkeys(residency)) == {resident}, what="residency republished as it is now")
    with StoreClient(store.address) as s:
        new = s.register(resident, other, overwrite=True)  # an invalidation through the Redis stream
    assert new.digest != old.digest
    with WorkerClient(worker.address, timeout=60) as w:
        assert_soon(
            lambda: w.generate(PROMPT, adapter_id=resident, max_tokens=2).adapter_digest == new.digest,
            what="the invalidation applied",
        )


def test_a_frozen_redis_does_not_hold_the_stores_fetches(system) -> None:
    """The store's registry waits on a hung Redis for a bounded moment (two 1 s socket timeouts),
    then streams what its cache holds under the last known record, and what needs the registry
    fails UNAVAILABLE within seconds, not after ~20 s of timeouts and retries."""
    import grpc

    server, store, worker = system
    names = [s.name for s in DEMO_ADAPTERS]
    with StoreClient(store.address) as s:
        for name in names:
            s.register(name, name)
        # both scripts cached in Redis: the frozen delete below must fail on the hung Redis, not
        # pass by luck when its first EVALSHA answers NOSCRIPT
        s.register("warm-delete", names[0])
        s.delete("warm-delete")
    with StoreClient(store.address, timeout=60) as s:
        for name in names:
            s.fetch(name)  # in the store's cache; none on the worker
    server.freeze()
    try:
        with WorkerClient(worker.address, timeout=20) as w:
            for name in names:
                t0 = time.monotonic()
                assert w.generate(PROMPT, adapter_id=name, max_tokens=2).adapter_id == name
                assert time.monotonic() - t0 < 8.0, name
        with StoreClient(store.address, timeout=20) as s:
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                s.delete(names[0])
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - t0 < 8.0
    finally:
        server.thaw()
    with StoreClient(store.address, timeout=8) as s:
        assert_soon(lambda: _deleted(s, names[0]), what="the registry back after Redis")


def _deleted(s: StoreClient, adapter_id: str) -> bool:
    """Deleted now, or already: the delete that timed out on the hung Redis may have run when it
    woke (an UNAVAILABLE write's outcome is unknown)."""
    import grpc

    try:
        s.delete(adapter_id)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            return False
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            raise
    return True
