"""A tensor-parallel worker whose follower dies or hangs (`loraserve worker --tensor-parallel-size 2`
as a real process): every call in flight, running or queued, ends with UNAVAILABLE naming the
rank, health goes NOT_SERVING, rank 0 exits with status 1 after one log line saying why, and no rank
is left running."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraserve.clients.worker_client import WorkerClient
from tests.helpers.tp_worker import WorkerProcess
from tests.inference_worker.parallel.conftest import needs_gloo

pytestmark = [needs_gloo, pytest.mark.slow, pytest.mark.timeout(60)]
# one sequence runs at a time, the other waits; a completion long enough to be cut short
FLAGS = ("--max-num-seqs", "1", "--max-num-batched-tokens", "64", "--num-kv-blocks", "256")
LONG = 1900
ENDS_WITHIN_S = 5.0  # a call in flight ends this soon after the follower dies


class StreamingCall:
    """A long GenerateStream read on a thread of its own: `started` once a token arrived, then
    `ended` with the call's error (None if it completed)."""

    def __init__(self, client: WorkerClient) -> None:
        self.started, self.ended = threading.Event(), threading.Event()
        self.error: grpc.RpcError | None = None
        self.num_tokens = 0
        threading.Thread(target=self._read, args=(client,), daemon=True).start()

    def _read(self, client: WorkerClient) -> None:
        try:
            for delta in client.generate_stream("Hello world", max_tokens=LONG, ignore_eos=True, timeout=45):
                self.num_tokens += len(delta.token_ids)
                self.started.set()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended.set()


def wait_until(predicate, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            pytest.fail(f"not within {timeout_s}s: {what}")
        time.sleep(0.02)


def not_serving(address: str) -> bool:
    """Health says NOT_SERVING, or the server is gone."""
    with grpc.insecure_channel(address) as channel:
        try:
            r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.UNAVAILABLE
        return r.status == health_pb2.HealthCheckResponse.NOT_SERVING


def check_failed_worker(w: WorkerProcess, cause: str) -> None:
    """Rank 0 exits with status 1 and one error line naming `cause`; no rank is left."""
    wait_until(lambda: not_serving(w.address), 10, "health NOT_SERVING or the server gone")
    assert w.proc.wait(timeout=20) == 1
    _, alive = psutil.wait_procs(w.processes, timeout=5)
    assert not alive, f"processes left running: {[p.pid for p in alive]}"
    errors = [line for line in w.log().splitlines() if "ERROR" in line]
    assert len(errors) == 1 and cause in errors[0], w.log()


def test_follower_killed_while_streaming_fails_running_and_queued_calls(tiny_model_dir, tmp_path):
    w = WorkerProcess(tiny_model_dir, tmp_path / "worker.log", *FLAGS)
    try:
        with WorkerClient(w.address) as client:
            running = StreamingCall(client)
            assert running.started.wait(20), "the first generation did not start"
            queued = StreamingCall(client)
            wait_until(lambda: client.info().num_waiting == 1, 10, "the second generation queued")
            w.follower.send_signal(signal.SIGKILL)
            for call in (running, queued):
                assert call.ended.wait(ENDS_WITHIN_S), "a call outlived the follower"
                assert call.error is not None, "the call completed"
                assert call.error.code() == grpc.StatusCode.UNAVAILABLE
                assert "tensor-parallel rank 1" in call.error.details()
                assert "SIGKILL" in call.error.details()
            assert running.num_tokens < LONG and queued.num_tokens == 0
            with pytest.raises(grpc.RpcError) as refused:
                client.generate("Hello", max_tokens=2)
            # refused by the failed servicer (UNAVAILABLE), or, once the server's stop has begun,
            # by gRPC itself (CANCELLED): which one depends on when the call lands, never served
            assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        check_failed_worker(w, "tensor-parallel rank 1")
    finally:
        w.kill_all()


def test_follower_killed_while_idle_stops_the_worker(tiny_model_dir, tmp_path):
    w = WorkerProcess(tiny_model_dir, tmp_path / "worker.log", *FLAGS)
    try:
        with WorkerClient(w.address) as client:
            assert len(client.generate("Hello", max_tokens=3, ignore_eos=True).token_ids) == 3
        w.follower.send_signal(signal.SIGKILL)
        check_failed_worker(w, "tensor-parallel rank 1")
    finally:
        w.kill_all()


def test_hung_follower_times_out_the_step(tiny_model_dir, tmp_path):
    """A follower that stops answering (SIGSTOP) fails the step after the step timeout; rank 0
    kills it on the way out."""
    w = WorkerProcess(tiny_model_dir, tmp_path / "worker.log", *FLAGS, "--tensor-parallel-timeout-s", "2")
    try:
        with WorkerClient(w.address) as client:
            running = StreamingCall(client)
            assert running.started.wait(20), "the generation did not start"
            os.kill(w.follower.pid, signal.SIGSTOP)
            assert running.ended.wait(2 + ENDS_WITHIN_S), "the call outlived the step timeout"
            assert running.error is not None and running.error.code() == grpc.StatusCode.UNAVAILABLE
            assert "collective with the other tensor-parallel ranks failed" in running.error.details()
        check_failed_worker(w, "collective with the other tensor-parallel ranks failed")
    finally:
        w.kill_all()
