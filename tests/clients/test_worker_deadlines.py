"""The worker clients' deadlines against workers that hang (real gRPC servers on port 0 whose calls
never end): without a timeout a unary call ends at DEFAULT_TIMEOUT_S and a stream whose first
message does not come within first_message_timeout is cancelled with DEADLINE_EXCEEDED, while a
stream that has started runs as long as it generates, and one with a deadline waits for its first
message until then; the router takes a worker whose stream did not start down."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from loraserve.clients import worker_client
from loraserve.clients.router import WorkerRouter
from loraserve.clients.worker_client import AsyncWorkerClient, FirstMessageTimeout, WorkerClient
from tests.helpers.fake_workers import FakeWorker, fake_workers

pytestmark = pytest.mark.timeout(60)


def _failure(call) -> tuple[grpc.StatusCode, float]:
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), time.monotonic() - t0


def _wait_for(check, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "not within the time"
        time.sleep(0.02)


def test_a_stream_that_does_not_start_ends_at_its_first_message_deadline() -> None:
    worker = FakeWorker()
    worker.hung_generations = True
    with fake_workers(worker) as (address,), WorkerClient(address, first_message_timeout=0.5) as client:
        code, took = _failure(lambda: list(client.generate_stream([1, 2], max_tokens=4)))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and 0.4 < took < 3.0
        _wait_for(lambda: worker.cancelled == 1)  # the call was cancelled at the worker too
        with pytest.raises(FirstMessageTimeout, match="no message within 0.5 s"):
            list(client.generate_stream([1, 2], max_tokens=4))


def test_a_stream_that_started_runs_past_the_first_message_deadline() -> None:
    worker = FakeWorker()
    worker.first_message_s, worker.stream_gap_s, worker.stream_messages = 0.2, 0.25, 6
    with fake_workers(worker) as (address,), WorkerClient(address, first_message_timeout=0.5) as client:
        t0 = time.monotonic()
        deltas = list(client.generate_stream([1, 2], max_tokens=6))
        assert [d.token_ids for d in deltas] == [[i] for i in range(6)] and time.monotonic() - t0 > 1.2


def test_a_stream_with_a_deadline_waits_for_its_first_message_as_long_as_that() -> None:
    """A caller's deadline (the gateway's --request-timeout-s, generate --timeout) bounds the wait
    for the first message itself: a queue or a prefill longer than first_message_timeout but within
    the deadline is no failure, in either client."""
    worker = FakeWorker()
    worker.first_message_s = 1.0
    with fake_workers(worker) as (address,):
        with WorkerClient(address, timeout=20.0, first_message_timeout=0.3) as client:
            assert [d.token_ids for d in client.generate_stream([1], max_tokens=2)] == [[0], [1]]
        with WorkerClient(address, first_message_timeout=0.3) as client:
            deltas = client.generate_stream([1], max_tokens=2, timeout=20.0)
            assert [d.token_ids for d in deltas] == [[0], [1]]

        async def go() -> list[list[int]]:
            async with AsyncWorkerClient(address, timeout=20.0, first_message_timeout=0.3) as client:
                return [d.token_ids async for d in client.generate_stream([1], max_tokens=2)]

        assert asyncio.run(go()) == [[0], [1]]


def test_a_stream_s_own_first_message_bound_holds_whatever_its_deadline() -> None:
    """A call's own first_message_timeout (the gateway's --first-message-timeout-s) bounds its first
    message within a deadline too, in either client."""
    worker = FakeWorker()
    worker.hung_generations = True
    with fake_workers(worker) as (address,):
        with WorkerClient(address, timeout=20.0) as client:
            stream = client.generate_stream([1], max_tokens=2, first_message_timeout=0.3)
            code, took = _failure(lambda: list(stream))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and took < 3.0

        async def go() -> float:
            async with AsyncWorkerClient(address, timeout=20.0) as client:
                t0 = time.monotonic()
                with pytest.raises(FirstMessageTimeout, match="no message within 0.3 s"):
                    async for _ in client.generate_stream([1], max_tokens=2, first_message_timeout=0.3):
                        pass
                return time.monotonic() - t0

        assert asyncio.run(go()) < 3.0
        _wait_for(lambda: worker.cancelled == 2)


def test_unary_calls_without_a_timeout_end_at_the_default_deadline(monkeypatch) -> None:
    monkeypatch.setattr(worker_client, "DEFAULT_TIMEOUT_S", 0.5)
    worker = FakeWorker()
    worker.hung = True
    with fake_workers(worker) as (address,), WorkerClient(address) as client:
        for call in (lambda: client.generate([1, 2], max_tokens=4), client.info, client.list_adapters):
            code, took = _failure(call)
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and took < 3.0
        # a timeout of the client's own is its deadline, a stream's whole run included
        with WorkerClient(address, timeout=0.3, first_message_timeout=None) as bounded:
            code, took = _failure(lambda: list(bounded.generate_stream([1], max_tokens=4)))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and took < 3.0


def test_the_asyncio_client_bounds_a_stream_s_first_message_too() -> None:
    worker = FakeWorker()
    worker.hung_generations = True
    with fake_workers(worker) as (address,):

        async def go() -> None:
            async with AsyncWorkerClient(address, first_message_timeout=0.5) as client:
                with pytest.raises(FirstMessageTimeout) as err:
                    async for _ in client.generate_stream([1, 2], max_tokens=4):
                        pass
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                worker.hung_generations = False
                worker.first_message_s, worker.stream_gap_s, worker.stream_messages = 0.2, 0.25, 4
                got = [d.token_ids async for d in client.generate_stream([1], max_tokens=4)]
                assert got == [[0], [1], [2], [3]]

        asyncio.run(go())
        _wait_for(lambda: worker.cancelled == 1)


def test_the_router_takes_a_worker_whose_stream_does_not_start_down() -> None:
    """The holder answers its refreshes but holds every generation: the stream routed to it ends at
    its first message deadline and the holder is down; the next request goes to the other worker."""
    holder, other = FakeWorker(gpu={"x"}), FakeWorker()
    holder.hung_generations = True
    with fake_workers(holder, other) as (a, b):
        with WorkerRouter([a, b], refresh_s=60.0, down_s=60.0, first_message_timeout=0.5) as router:
            assert [w.address for w in router.candidates("x")] == [a, b]
            code, took = _failure(lambda: list(router.generate_stream([1], adapter_id="x", max_tokens=2)))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and took < 3.0
            assert [w.address for w in router.candidates("x")] == [b]
            assert [d.text for d in router.generate_stream([1], adapter_id="x", max_tokens=2)] == [b, b]


def test_a_failed_stream_leaves_no_cycle() -> None:
    """A stream that ends with an error (its deadline, its first-message bound) leaves nothing for
    the garbage collector: the error raised is the gRPC call itself, so a frame of the client that
    kept the call would be a cycle through the error's traceback."""
    from tests.helpers.saved_garbage import garbage, of_worker, saving_garbage

    worker = FakeWorker()
    worker.hung_generations = True
    with fake_workers(worker) as (address,), WorkerClient(address) as client:
        with saving_garbage():
            garbage(of_worker)
            for _ in range(2):
                with pytest.raises(grpc.RpcError):
                    list(client.generate_stream("Hi", max_tokens=2, timeout=0.3))
                with pytest.raises(FirstMessageTimeout):
                    list(client.generate_stream("Hi", max_tokens=2, first_message_timeout=0.3))
            assert garbage(of_worker) == []
