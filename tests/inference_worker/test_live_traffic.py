"""Live traffic against a real worker and a real store: many concurrent streams over adapters that
do not all fit its tiers (fetches, look-ahead, evictions on other threads), clients that hang up
mid-stream, deadlines that expire while a request waits, prefills or decodes. The interpreter
switches threads at the worker's lowest setting (`--switch-interval-ms 0.05`; the worker's
default is 0.5, Python's 5), so the step thread, the event loop and the adapter threads interleave
at least as often as in production. (At this load it caught a race between the step thread's
deadline scan and submit() in two runs of three.) Every call ends OK or with the status its client caused (CANCELLED,
DEADLINE_EXCEEDED), never INTERNAL/UNKNOWN; afterwards every KV block is free, nothing is left
running, and the worker still answers."""

from __future__ import annotations

import asyncio
import random
import sys
import time

import pytest

from tests.helpers.lora_store import ADAPTER_SPECS

REQUESTS, CONCURRENCY = 1500, 256
WORKER_SWITCH_INTERVAL_S = 0.05e-3


async def _drive(address: str, seed: int) -> list[str]:
    import grpc

    from loraserve.v1 import worker_pb2, worker_pb2_grpc

    rng = random.Random(seed)
    adapters = ["", *ADAPTER_SPECS]
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(stub, i: int) -> str:
        req = worker_pb2.GenerateRequest(
            request_id=f"live-{i}",
            prompt_token_ids=[rng.randrange(3, 250) for _ in range(rng.randint(1, 40))],
            adapter_id=rng.choice(adapters),
        )
        req.sampling.max_tokens = rng.randint(1, 24)
        req.sampling.ignore_eos = True
        req.sampling.temperature = rng.choice([0.0, 0.8])
        hang_up_after = rng.randint(1, 3) if rng.random() < 0.1 else None  # messages, then cancel
        timeout = rng.choice([0.005, 0.05, 0.3]) if rng.random() < 0.1 else 60.0
        async with gate:
            call = stub.GenerateStream(req, timeout=timeout)
            try:
                seen = 0
                async for _ in call:
                    seen += 1
                    if hang_up_after is not None and seen >= hang_up_after:
                        call.cancel()
                        return "CANCELLED"
                return "OK"
            except grpc.aio.AioRpcError as exc:
                return (
                    exc.code().name
                    if exc.code() != grpc.StatusCode.INTERNAL
                    else f"INTERNAL: {exc.details()}"
                )
            except asyncio.CancelledError:
                return "CANCELLED"

    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.InferenceWorkerStub(channel)
        return list(await asyncio.gather(*(one(stub, i) for i in range(REQUESTS))))


@pytest.mark.slow
def test_live_traffic_over_many_adapters_ends_every_call_cleanly(start_worker, lora_store) -> None:
    from loraserve.clients.worker_client import WorkerClient

    bg = start_worker(
        store_address=lora_store.address,
        max_num_seqs=64,
        max_num_batched_tokens=256,
        num_kv_blocks=512,
        max_queue_size=512,
        max_loras=2,  # fewer slots and CPU entries than adapters: loads and evictions all along
        max_cpu_loras=3,
    )
    before = sys.getswitchinterval()
    sys.setswitchinterval(WORKER_SWITCH_INTERVAL_S)  # this process runs the worker
    try:
        outcomes = asyncio.run(_drive(bg.address, seed=11))
    finally:
        sys.setswitchinterval(before)
    unexpected = [o for o in outcomes if o not in ("OK", "CANCELLED", "DEADLINE_EXCEEDED")]
    assert not unexpected, unexpected[:5]
    assert outcomes.count("OK") > REQUESTS // 2, outcomes
    assert {"CANCELLED", "DEADLINE_EXCEEDED"} <= set(outcomes), outcomes  # both ends were exercised
    registry = bg.server.metrics.registry
    for tier in ("gpu", "cpu"):  # the adapters moved through both tiers during the run
        assert (
            registry.get_sample_value("loraserve_worker_adapter_evictions_total", {"tier": tier}) or 0
        ) > 0
    engine = bg.engine
    deadline = time.monotonic() + 10
    while engine.blocks.num_free_blocks != engine.blocks.num_usable_blocks or not engine.idle:
        assert time.monotonic() < deadline, "KV blocks or requests left behind"
        time.sleep(0.05)
    with WorkerClient(bg.address, timeout=30) as w:  # and it still serves, with an adapter
        assert len(w.generate([5, 17, 42], adapter_id="qv-r8", max_tokens=3, ignore_eos=True).token_ids) == 3
