"""Starting a tensor-parallel worker's ranks: rank 0 (the process that serves gRPC) hosts the
rendezvous store on 127.0.0.1 (a free port, bound by the store itself) and starts ranks 1..N-1 as
child processes (`python -m loraserve.inference_worker.parallel.follower`), handing each the
worker's configuration on stdin and MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE in its
environment.

No orphans: a follower exits on rank 0's STOP, when a collective fails because rank 0 is gone, or
when its parent process changes (rank 0 killed); rank 0 kills followers that outlive `join`'s
grace, and at interpreter exit.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from loraserve.inference_worker.config import WorkerConfig
from loraserve.inference_worker.model.config import ModelConfigError
from loraserve.inference_worker.parallel.group import TensorParallelGroup

log = logging.getLogger("loraserve.worker")
LEADER_PID = "LORASERVE_TP_LEADER_PID"
JOINED = "loraserve/joined/{}"  # store key a follower sets just before joining the group
START_TIMEOUT_S = 600.0


def follower_config_json(config: WorkerConfig) -> str:
    """The configuration a follower needs: the worker's, without its secrets."""
    fields = dataclasses.asdict(config)
    fields.update(store_token=None, generate_token=None, admin_token=None)
    return json.dumps(fields)


class FollowerProcesses:
    """Ranks 1..N-1 of this worker, child processes of rank 0."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs
        atexit.register(self.kill)

    @classmethod
    def spawn(cls, config: WorkerConfig, port: int) -> FollowerProcesses:
        size = config.tensor_parallel_size
        cmd = [sys.executable, "-m", "loraserve.inference_worker.parallel.follower"]
        procs = []
        for rank in range(1, size):
            env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(size),
                LEADER_PID: str(os.getpid()),
            }
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(follower_config_json(config).encode())
            proc.stdin.close()
            procs.append(proc)
        return cls(procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_joined(self, store: dist.Store, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every follower is about to join the group; ModelConfigError if one exited first."""
        keys = [JOINED.format(rank) for rank in range(1, len(self.procs) + 1)]
        end = time.monotonic() + timeout_s
        while not store.check(keys):
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    raise ModelConfigError(
                        f"tensor-parallel rank {rank} exited at start-up (code {proc.returncode})"
                    )
            if time.monotonic() > end:
                raise ModelConfigError(f"tensor-parallel ranks did not start within {timeout_s:.0f}s")
            time.sleep(0.05)

    def join(self, timeout_s: float = 30.0) -> None:
        """Wait for the followers to exit (they were told to); kill the ones still running after."""
        end = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel follower %d did not exit; killing it", proc.pid)
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def start_leader(config: WorkerConfig, device: torch.device) -> tuple[TensorParallelGroup, FollowerProcesses]:
    """Rank 0: host the rendezvous, start the followers, join the group with them."""
    size = config.tensor_parallel_size
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
    followers = FollowerProcesses.spawn(config, store.port)
    try:
        followers.wait_joined(store)
        tp = TensorParallelGroup.initialize(0, size, device, store, _step_timeout(config))
    except BaseException:
        followers.kill()
        raise
    log.info("tensor parallel over %d ranks on %s (followers: pids %s)", size, device.type, followers.pids)
    return tp, followers


def join_as_follower(config: WorkerConfig, rank: int, device: torch.device) -> TensorParallelGroup:
    """Rank r > 0: reach rank 0's store from MASTER_ADDR / MASTER_PORT and join the group."""
    size = config.tensor_parallel_size
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False)
    store.set(JOINED.format(rank), "1")
    return TensorParallelGroup.initialize(rank, size, device, store, _step_timeout(config))


def _step_timeout(config: WorkerConfig) -> timedelta:
    return timedelta(seconds=config.tensor_parallel_timeout_s)
