"""Popularity prefetch across the fleet: two real workers sharing a real Redis and a real store.
The first serves skewed traffic and publishes its decayed request counts; the second, idle,
prefetches the fleet's hot adapters (each of these four carries over 2 % of the requests, so
every worker holds them), so when traffic moves to it (the first restarts, scales in) its
requests find their adapters resident. Without prefetch they miss."""

from __future__ import annotations

import time

import pytest

from tests.helpers.workers import worker_config

PROMPT = [5, 17, 42, 99, 7, 3]
# skewed: the most popular first
TRAFFIC = ["qv-r8"] * 4 + ["all-r4"] * 3 + ["mlp-rs16"] * 2 + ["patterned"]


def generate(address: str, adapter_id: str):
    from loraserve.clients.worker_client import WorkerClient

    with WorkerClient(address, timeout=60) as w:
        return w.generate(PROMPT, adapter_id=adapter_id, max_tokens=3)


def held(address: str) -> set[str]:
    """Adapters resident on the worker: in a GPU slot or the CPU tier (not still loading)."""
    from loraserve.clients.worker_client import WorkerClient
    from loraserve.v1 import worker_pb2

    resident = (worker_pb2.ADAPTER_TIER_GPU, worker_pb2.ADAPTER_TIER_CPU)
    with WorkerClient(address, timeout=10) as w:
        return {a.adapter_id for a in w.list_adapters() if a.tier in resident}


@pytest.mark.redis
@pytest.mark.parametrize("prefetch", [4, 0])
def test_second_worker_finds_the_fleets_popular_adapters_resident(
    tiny_model_dir, lora_store, redis_url, redis_prefix, prefetch
):
    from loraserve.inference_worker.server import BackgroundWorker

    def start(worker_id: str) -> BackgroundWorker:
        return BackgroundWorker(
            worker_config(
                tiny_model_dir,
                store_address=lora_store.address,
                redis_url=redis_url,
                redis_prefix=redis_prefix,
                worker_id=worker_id,
                max_loras=2,
                max_cpu_loras=6,
                adapter_prefetch=prefetch,
                adapter_poll_interval_s=0.1,
            )
        )

    first, second = start("first"), start("second")
    try:
        for adapter_id in TRAFFIC:
            generate(first.address, adapter_id)
        popular = set(TRAFFIC)
        if prefetch:  # in the background, a few adapters per coordination round
            end = time.monotonic() + 20
            while held(second.address) != popular:
                assert time.monotonic() < end, held(second.address)
                time.sleep(0.05)
        else:
            time.sleep(1.0)  # ten coordination rounds: nothing arrives
            assert held(second.address) == set()
        # the traffic moves to the second worker: where was each adapter on arrival?
        tiers = [generate(second.address, a).usage.adapter_tier for a in dict.fromkeys(TRAFFIC)]
        resident = sum(t in ("gpu", "cpu") for t in tiers) / len(tiers)
        assert resident == (1.0 if prefetch else 0.0), tiers
    finally:
        first.stop()
        second.stop()
