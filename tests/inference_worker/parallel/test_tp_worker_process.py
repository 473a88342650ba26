"""`loraserve worker --tensor-parallel-size 2` as a real process (gRPC on 127.0.0.1, port 0): it
starts its follower, generates like a one-process worker, and every rank exits on drain; a follower
whose rank 0 is killed exits too."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from tests.helpers.tp_worker import WorkerProcess
from tests.inference_worker.parallel.conftest import needs_gloo

pytestmark = [needs_gloo, pytest.mark.slow, pytest.mark.timeout(120)]


def test_generates_then_drains_every_rank(tiny_model_dir, worker, tmp_path):
    from loraserve.clients.worker_client import WorkerClient

    w = WorkerProcess(tiny_model_dir, tmp_path / "worker.log")
    try:
        assert len(w.ranks) == 2, "rank 0 starts one follower"
        with WorkerClient(w.address) as client, WorkerClient(worker.address) as single:
            got = client.generate("Hello world", max_tokens=6, ignore_eos=True)
            want = single.generate("Hello world", max_tokens=6, ignore_eos=True)
        assert got.token_ids == want.token_ids and len(got.token_ids) == 6
        os.kill(w.proc.pid, signal.SIGTERM)
        gone, alive = psutil.wait_procs(w.ranks, timeout=30)
        assert not alive, f"ranks still running after drain: {[p.pid for p in alive]}"
        assert w.proc.wait(5) == 0
    finally:
        w.kill_all()


def test_follower_exits_when_rank0_is_killed(tiny_model_dir, tmp_path):
    w = WorkerProcess(tiny_model_dir, tmp_path / "worker.log")
    try:
        follower = w.ranks[1]
        w.proc.kill()
        gone, alive = psutil.wait_procs([follower], timeout=15)
        assert not alive, "the follower outlived rank 0"
    finally:
        w.kill_all()
