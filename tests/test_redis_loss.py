"""Redis restarts empty (no persistence) under a running store, whose registry is there, and a
worker: neither takes the empty Redis for every adapter deleted. The worker keeps what it holds and
republishes its residency and pins, the store restores its registry from its own copy, and a
deletion made after the loss still reaches the worker."""

from __future__ import annotations

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
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server binary"),
]
PROMPT = [7, 21, 63, 189, 11]
PREFIX = "loraserve-loss:"
WORKER = "w-loss"


@pytest.fixture
def system(
    tiny_model_dir: Path, tmp_path: Path
) -> Iterator[tuple[PrivateRedis, BackgroundStore, BackgroundWorker]]:
    with redis_system(
        tiny_model_dir,
        tmp_path,
        prefix=PREFIX,
        worker_id=WORKER,
        adapter_poll_interval_s=0.1,
        worker_log_level="ERROR",
        redis_options=("--save", "", "--appendonly", "no"),
    ) as running:
        yield running


def _held(w: WorkerClient) -> dict[str, str]:
    return {a.adapter_id: a.digest for a in w.list_adapters()}


def test_an_empty_redis_is_not_every_adapter_deleted(system) -> None:
    import redis

    server, store, worker = system
    used, pinned, _ = (s.name for s in DEMO_ADAPTERS)
    with StoreClient(store.address) as s:
        digests = {n: s.register(n, n).digest for n in (used, pinned)}
    with WorkerClient(worker.address, timeout=60) as w:
        before = w.generate(PROMPT, adapter_id=used, max_tokens=6).token_ids
        w.pin_adapter(pinned)
        assert _held(w) == digests
    r = redis.Redis.from_url(server.url, decode_responses=True)
    assert_soon(
        lambda: set(r.hkeys(PREFIX + f"residency:{WORKER}")) == set(digests), what="residency published"
    )

    server.stop()
    server.start()
    r = redis.Redis.from_url(server.url, decode_responses=True)
    # the worker's own soft state is republished, and the store's registry restored
    assert_soon(
        lambda: set(r.hkeys(PREFIX + f"residency:{WORKER}")) == set(digests), what="residency republished"
    )
    assert_soon(lambda: r.smembers(PREFIX + f"pins:{WORKER}") == {pinned}, what="pins republished")
    assert_soon(lambda: r.zrange(PREFIX + "adapters", 0, -1) == sorted(digests), what="registry restored")
    time.sleep(1.0)  # ten rounds of the worker's store check
    with WorkerClient(worker.address, timeout=60) as w:
        assert _held(w) == digests  # nothing dropped
        assert w.generate(PROMPT, adapter_id=used, max_tokens=6).token_ids == before

        with StoreClient(store.address) as s:  # a deletion after the loss is honoured
            s.delete(used)
        assert_soon(lambda: used not in _held(w), what="the deleted adapter dropped")
        with pytest.raises(grpc.RpcError) as err:
            w.generate(PROMPT, adapter_id=used, max_tokens=6)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        # the failed fetch is listed ("loading") until the worker's loop has ended it
        assert_soon(lambda: _held(w) == {pinned: digests[pinned]}, what="only the pinned adapter held")
