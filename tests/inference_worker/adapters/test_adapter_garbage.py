"""The adapter path leaves nothing for the garbage collector: fetches (stored, refused by the
store, cancelled midway), copies into GPU slots and evictions from both tiers are freed by reference
counts when they end, through the fetch threads and through the fetch process; so is a request
whose adapter could not be fetched, in the engine and in the gRPC service.

A failed fetch used to keep its error raised: the traceback held the fetch's frames (its gRPC call,
its download and buffer) and the flight, and, raised again at admission, the step thread's frames
(the scheduler's lists of sequences), each in a reference cycle; a collection of such cycles stops
every thread of the worker while it walks and frees them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from loraserve.inference_worker.adapters import AdapterRef
from loraserve.inference_worker.errors import AdapterNotFound
from loraserve.inference_worker.fetching.process import FetchProcess
from tests.helpers.saved_garbage import garbage, of_worker, saving_garbage
from tests.helpers.workers import wait_for

FETCH_PATHS = [
    "threads",
    pytest.param(
        "process", marks=pytest.mark.skipif(not FetchProcess.supported(), reason="no shared memory")
    ),
]


@contextlib.contextmanager
def stalled(store) -> Iterator[None]:
    """The store's event loop held: a fetch sent to it is answered only once the block ends."""
    release = threading.Event()
    store.store._loop.call_soon_threadsafe(release.wait, 30)
    try:
        yield
    finally:
        release.set()


@pytest.mark.parametrize("fetch_path", FETCH_PATHS)
def test_fetches_loads_and_evictions_leave_no_cycles(harness, lora_store, fetch_path: str) -> None:
    # one fetch at a time: a fetch queued behind a cancelled one starts once that one has ended
    h = harness(max_loras=2, max_cpu_loras=2, max_fetches=1, fetch_process=fetch_path == "process")
    names = ["qv-r8", "all-r4", "mlp-rs16", "patterned"]
    value = h.pool.metrics.value
    key = iter(range(1, 1000))
    h.acquire_eventually(0, "qv-r8")  # (the fetch threads or process started)
    h.pool.release(0)
    with saving_garbage():
        garbage(of_worker)  # (what starting them left)
        # fetched, copied into a slot, evicted from both tiers by the next ones
        for name in names * 2:
            seq_key = next(key)
            h.acquire_eventually(seq_key, name)
            h.pool.release(seq_key)
        assert value("loraserve_worker_adapter_loads_total", {"tier": "cpu", "result": "ok"}) >= 6
        assert value("loraserve_worker_adapter_evictions_total", {"tier": "cpu"}) >= 4
        assert value("loraserve_worker_adapter_evictions_total", {"tier": "gpu"}) >= 4
        assert garbage(of_worker) == []

        # refused by the store: the sequence that waited for it fails with the store's answer
        for _ in range(2):
            seq_key = next(key)
            with pytest.raises(AdapterNotFound):
                h.acquire_eventually(seq_key, "no-such-adapter")
            h.pool.release(seq_key)
        assert garbage(of_worker) == []

        # given up while the store has it (an operator's load whose caller went away): the fetch,
        # which requests queued for the adapter may share, goes on and lands in the CPU tier
        with stalled(lora_store):
            load = asyncio.run_coroutine_threadsafe(h.ensure_cpu("attn-l1-r2"), h.loop)
            assert wait_for(lambda: h.pool.fetcher.gate is not None and h.pool.fetcher.gate.running == 1)
            load.cancel()
            with pytest.raises(concurrent.futures.CancelledError):
                load.result(10)
            assert h.pool.fetcher.flights
        assert wait_for(lambda: not h.pool.fetcher.flights)
        assert h.pool.arrival_tier(AdapterRef.parse("attn-l1-r2")) == "cpu"
        h.run(h.ensure_cpu("attn-l1-r2"))  # held: no fetch
        time.sleep(0.2)  # (the answer's release, in the fetch process)
        assert garbage(of_worker) == []


def test_a_request_whose_adapter_failed_leaves_no_cycles(tiny_model_dir, lora_store) -> None:
    """In the engine: a sequence refused at admission keeps why, and the step's frames must not."""
    from tests.helpers.local_worker import LocalWorker

    worker = LocalWorker(tiny_model_dir, lora_store.address, max_loras=2, max_cpu_loras=2, lookahead=2)
    try:
        worker.generate([5, 6, 7], "qv-r8", max_tokens=2)  # (first use)
        with saving_garbage():
            garbage(of_worker)
            futures = [worker.submit([5, 6, 7], "no-such-adapter", 4) for _ in range(2)]
            futures.append(worker.submit([5, 6, 7], "all-r4", 4))  # queued beside them
            errors = [type(f.result(60)[1]).__name__ for f in futures]
            assert errors == ["AdapterNotFound"] * 2 + ["NoneType"]
            del futures  # (their outputs, as the service lets go of them)
            assert garbage(of_worker) == []
    finally:
        worker.close()


def test_a_failed_generate_leaves_no_cycles(start_worker, lora_store) -> None:
    """In the gRPC service: a request failed with the engine's error (here the store's NOT_FOUND)."""
    import grpc

    from loraserve.clients.worker_client import WorkerClient

    worker = start_worker(store_address=lora_store.address, max_loras=2, max_cpu_loras=2)
    with WorkerClient(worker.address, timeout=60) as client:
        client.generate("hello", adapter_id="qv-r8", max_tokens=2)  # (first use)
        with saving_garbage():
            garbage(of_worker)
            for _ in range(2):
                with pytest.raises(grpc.RpcError) as failed:
                    client.generate("hello", adapter_id="no-such-adapter", max_tokens=2)
                assert failed.value.code() == grpc.StatusCode.NOT_FOUND
            del failed
            assert garbage(of_worker) == []
