"""Redis goes away and comes back under a running store and worker (a private redis-server on a
free port with an append-only file, as the registry's Redis is deployed, killed and restarted):
both keep serving what they hold, admin work that needs Redis gets UNAVAILABLE, and the worker
republishes its heartbeat and its residency, as it is now, once Redis answers again."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
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
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server binary"),
]
PROMPT = [7, 21, 63, 189, 11]


@pytest.fixture
def system(
    tiny_model_dir: Path, tmp_path: Path
) -> Iterator[tuple[PrivateRedis, BackgroundStore, BackgroundWorker, str]]:
    prefix = "loraserve-outage:"
    with redis_system(
        tiny_model_dir, tmp_path, prefix=prefix, worker_id="w-outage", adapter_poll_interval_s=0.1
    ) as (server, store, worker):
        yield server, store, worker, prefix


def test_services_ride_out_a_redis_outage(system) -> None:
    import redis

    server, store, worker, prefix = system
    cached, other, late = (s.name for s in DEMO_ADAPTERS)
    with StoreClient(store.address) as s:
        s.register(cached, cached)
        s.register(other, other)
    with WorkerClient(worker.address, timeout=60) as w:
        before = w.generate(PROMPT, adapter_id=cached, max_tokens=6).token_ids
        base = w.generate(PROMPT, max_tokens=6).token_ids
    r = redis.Redis.from_url(server.url, decode_responses=True)
    assert_soon(lambda: cached in r.hkeys(prefix + "residency:w-outage"), what="residency published")

    server.stop()
    with WorkerClient(worker.address, timeout=60) as w:
        assert w.generate(PROMPT, adapter_id=cached, max_tokens=6).token_ids == before
        assert w.generate(PROMPT, max_tokens=6).token_ids == base
        # not on the worker, but in the store's cache: streamed under its last known record
        other_tokens = w.generate(PROMPT, adapter_id=other, max_tokens=6).token_ids
        assert other_tokens != base
        assert w.unload_adapter(cached)
    with StoreClient(store.address) as s:
        with pytest.raises(grpc.RpcError) as err:
            s.register(late, late)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as err:
            s.get(cached)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    server.start()  # same data (append-only file); what changed during the outage must converge
    r = redis.Redis.from_url(server.url, decode_responses=True)
    assert_soon(lambda: r.get(prefix + "worker:w-outage") is not None, what="heartbeat after reconnect")
    assert json.loads(r.get(prefix + "worker:w-outage"))["address"] == worker.address
    assert_soon(
        lambda: set(r.hkeys(prefix + "residency:w-outage")) == {other},
        what="residency republished as it is now",
    )
    with StoreClient(store.address) as s:
        assert s.register(late, late).adapter_id == late
    with WorkerClient(worker.address, timeout=60) as w:
        assert w.generate(PROMPT, adapter_id=cached, max_tokens=6).token_ids == before
        assert w.generate(PROMPT, adapter_id=other, max_tokens=6).token_ids == other_tokens
        assert w.generate(PROMPT, adapter_id=late, max_tokens=6).token_ids != base


def test_a_change_the_store_check_finds_during_an_outage_reaches_redis_after(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A store with its own registry (SQLite) and a worker on Redis: the worker learns of a
    re-registration by its store check and announces it through the Redis stream. Found while Redis
    is down, the announcement waits for Redis instead of being dropped, so the stale copy goes."""
    replaced, other, _ = (s.name for s in DEMO_ADAPTERS)
    system = redis_system(
        tiny_model_dir,
        tmp_path,
        prefix="loraserve-check:",
        worker_id="w-check",
        adapter_poll_interval_s=0.1,
        worker_log_level="ERROR",
        store_on_redis=False,
    )
    with system as (server, store, worker):
        with StoreClient(store.address) as s:
            old = s.register(replaced, replaced)
        with WorkerClient(worker.address, timeout=60) as w:
            assert w.generate(PROMPT, adapter_id=replaced, max_tokens=2).adapter_digest == old.digest
            server.stop()
            with StoreClient(store.address) as s:
                new = s.register(replaced, other, overwrite=True)  # the store needs no Redis
            assert new.digest != old.digest
            time.sleep(1.0)  # several rounds of the store check, each finding the change
            server.start()
            assert_soon(
                lambda: w.generate(PROMPT, adapter_id=replaced, max_tokens=2).adapter_digest == new.digest,
                what="the change announced once Redis is back",
            )
