"""A store and a worker sharing a private redis-server, for the tests that stop, freeze or restart
Redis under running services. The services are imported inside: see store_fixtures.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from tests.helpers.ports import free_port
from tests.helpers.private_redis import PrivateRedis
from tests.helpers.workers import wait_for

if TYPE_CHECKING:
    from loraserve.adapter_store.server import BackgroundStore
    from loraserve.inference_worker.server import BackgroundWorker


@contextmanager
def redis_system(
    model_dir: Path,
    directory: Path,
    *,
    prefix: str,
    worker_id: str,
    adapter_poll_interval_s: float,
    worker_log_level: str = "WARNING",
    store_on_redis: bool = True,
    redis_options: Sequence[str] | None = None,
) -> Iterator[tuple[PrivateRedis, BackgroundStore, BackgroundWorker]]:
    """A private Redis, the demo adapters on local disk, a store and a worker (2 GPU slots, 4 CPU
    slots) on it under `prefix`; all stopped on exit. Without `store_on_redis` the store keeps its
    registry to itself (SQLite) and only the worker uses Redis. `redis_options`: redis-server's (an
    append-only file by default; `("--save", "", "--appendonly", "no")`: a restart empties it)."""
    from loraserve.adapter_store.config import StoreConfig
    from loraserve.adapter_store.demo import write_demo_adapters
    from loraserve.adapter_store.server import BackgroundStore
    from loraserve.inference_worker.config import WorkerConfig
    from loraserve.inference_worker.server import BackgroundWorker

    # stopped at the end: no keys to clean up
    server = PrivateRedis(directory) if redis_options is None else PrivateRedis(directory, redis_options)
    server.start()
    write_demo_adapters(directory / "adapters", model_dir)
    store = BackgroundStore(
        StoreConfig(
            base_model=str(model_dir),
            port=0,
            data_dir=str(directory / "store"),
            adapter_root=str(directory / "adapters"),
            serving_dtype="float32",
            redis_url=server.url if store_on_redis else None,
            redis_prefix=prefix,
            log_level="WARNING",
        )
    )
    worker_port = free_port()
    worker = BackgroundWorker(
        WorkerConfig(
            model=str(model_dir),
            port=worker_port,
            device="cpu",
            dtype="float32",
            store_address=store.address,
            redis_url=server.url,
            redis_prefix=prefix,
            worker_id=worker_id,
            max_loras=2,
            max_cpu_loras=4,
            num_kv_blocks=128,
            max_num_seqs=8,
            advertise_address=f"127.0.0.1:{worker_port}",
            adapter_poll_interval_s=adapter_poll_interval_s,
            log_level=worker_log_level,
        )
    )
    try:
        yield server, store, worker
    finally:
        worker.stop()
        store.stop()
        server.stop()


def assert_soon(predicate: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    """Fails the test unless `predicate()` holds within `timeout` seconds (polled every 0.1 s: some
    predicates are calls to the services)."""
    assert wait_for(predicate, timeout, interval=0.1), f"timed out waiting for {what}"
