"""Workers bound to port 0 take their id and advertised address from the port they got, so two of
them on one machine never share coordination keys."""

from __future__ import annotations

import time

import pytest

from loraserve.clients.router import discover_workers
from loraserve.inference_worker.server import BackgroundWorker
from tests.helpers.workers import worker_config


@pytest.mark.redis
def test_port_zero_workers_are_distinct_in_redis(tiny_model_dir, lora_store, redis_url, redis_prefix) -> None:
    prefix = redis_prefix
    workers = [
        BackgroundWorker(
            worker_config(
                tiny_model_dir,
                max_num_batched_tokens=512,
                max_queue_size=256,
                store_address=lora_store.address,
                redis_url=redis_url,
                redis_prefix=prefix,
                num_kv_blocks=64,
                max_num_seqs=4,
                adapter_poll_interval_s=0.1,
            )
        )
        for _ in range(2)
    ]
    try:
        ids = [w.server.config.resolved_worker_id for w in workers]
        assert len(set(ids)) == 2
        for w, worker_id in zip(workers, ids, strict=True):
            assert worker_id.endswith(f"-{w.port}")
        deadline = time.monotonic() + 15
        while sorted(discover_workers(redis_url, prefix)) != sorted(w.address for w in workers):
            assert time.monotonic() < deadline, discover_workers(redis_url, prefix)
            time.sleep(0.1)
    finally:
        for w in workers:
            w.stop()
