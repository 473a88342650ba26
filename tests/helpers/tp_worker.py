"""`loraserve worker --tensor-parallel-size 2` as a real process: CPU, fp32, gRPC on 127.0.0.1 port 0,
its log in a file. `ranks` holds rank 0 and its follower, `processes` those and the worker's helper
processes (its stream relay's front), found once the worker listens."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from loraserve.serving.ports import listening_address

HELPER_MODULES = ("inference_worker.relay.front", "inference_worker.fetching.child")


def _helper(p: psutil.Process) -> bool:
    try:
        cmdline = " ".join(p.cmdline())
    except psutil.Error:
        return False
    return any(m in cmdline for m in HELPER_MODULES)


class WorkerProcess:
    def __init__(self, model_dir: Path, log_path: Path, *flags: str) -> None:
        cmd = [sys.executable, "-m", "loraserve", "worker", "--model", str(model_dir)]
        cmd += ["--port", "0", "--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", "2"]
        cmd += ["--num-kv-blocks", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
        cmd += ["--grace-period-s", "10", "--log-level", "WARNING", *flags]
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        self.address = self._wait_listening(timeout_s=60)
        main = psutil.Process(self.proc.pid)
        self.processes = [main, *main.children(recursive=True)]
        # the tensor-parallel ranks: not the worker's helper processes (the stream relay's front)
        self.ranks = [main, *(p for p in self.processes[1:] if not _helper(p))]

    def _wait_listening(self, timeout_s: float) -> str:
        found: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if address := listening_address(line):
                    found.append(address)
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not found:
            self.proc.kill()
            pytest.fail(f"the worker did not start (exit code {self.proc.poll()}): {self.log()}")
        return found[0]

    @property
    def follower(self) -> psutil.Process:
        return self.ranks[1]

    def log(self) -> str:
        return self.log_path.read_text()

    def kill_all(self) -> None:
        for p in self.processes:
            if p.is_running():
                p.kill()
