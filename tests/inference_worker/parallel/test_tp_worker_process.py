"""`loraserve worker --tensor-parallel-size 2` as a real process (gRPC on 127.0.0.1, port 0): it
starts its follower, generates like a one-process worker, and every rank exits on drain; a follower
whose rank 0 is killed exits too."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from tests.inference_worker.parallel.conftest import needs_gloo

pytestmark = [needs_gloo, pytest.mark.slow, pytest.mark.timeout(120)]
LISTENING = re.compile(r"listening on ([\d.]+):(\d+)")


class WorkerProcess:
    def __init__(self, model_dir: Path) -> None:
        cmd = [sys.executable, "-m", "loraserve", "worker", "--model", str(model_dir)]
        cmd += ["--port", "0", "--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", "2"]
        cmd += ["--num-kv-blocks", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
        cmd += ["--grace-period-s", "10", "--log-level", "WARNING"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.address = self._wait_listening(timeout_s=60)
        self.ranks = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]

    def _wait_listening(self, timeout_s: float) -> str:
        found: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                m = LISTENING.search(line)
                if m:
                    found.append(f"{m.group(1)}:{m.group(2)}")
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not found:
            self.proc.kill()
            pytest.fail(f"the worker did not start (exit code {self.proc.poll()})")
        return found[0]

    def kill_all(self) -> None:
        for p in self.ranks:
            if p.is_running():
                p.kill()


def test_generates_then_drains_every_rank(tiny_model_dir, worker):
    from loraserve.clients.worker_client import WorkerClient

    w = WorkerProcess(tiny_model_dir)
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


def test_follower_exits_when_rank0_is_killed(tiny_model_dir):
    w = WorkerProcess(tiny_model_dir)
    try:
        follower = w.ranks[1]
        w.proc.kill()
        gone, alive = psutil.wait_procs([follower], timeout=15)
        assert not alive, "the follower outlived rank 0"
    finally:
        w.kill_all()
