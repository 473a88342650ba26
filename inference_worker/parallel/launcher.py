"""Starting a tensor-parallel worker's ranks: rank 0 (the process that serves gRPC) hosts the
rendezvous store on 127.0.0.1 (a free port, bound by the store itself) and starts ranks 1..N-1 as
child processes (`python -m loraserve.inference_worker.parallel.follower`), handing each the
worker's configuration on stdin and MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE in its
environment.

No orphans: a follower exits on rank 0's STOP, when a collective fails because rank 0 is gone, or
when its parent process changes (rank 0 killed); rank 0 kills followers that outlive `join`'s
grace, the ones left when another dies or a collective fails, and at interpreter exit.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from loraserve.inference_worker.config import WorkerConfig
from loraserve.inference_worker.errors import RankFailed
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
    """Ranks 1..N-1 of this worker, child processes of rank 0, each watched by a thread blocked in
    `wait()` on it: a follower that exits unasked (killed, OOM, crashed) fails the group at once.

    A failure is reported once, to the listeners given to `on_failure` (called on the watcher's
    thread), after the other followers are killed: without every rank the group cannot compute, and
    a follower left waiting in a collective on the dead one would never return."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs
        self._lock = threading.Lock()
        self._failure: RankFailed | None = None
        self._failed = threading.Event()
        self._listeners: list[Callable[[RankFailed], None]] = []
        self._expect_exit = False  # set before rank 0 tells them to stop: exits are then no failure
        for rank, proc in enumerate(procs, start=1):
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"tp-rank-{rank}-watch", daemon=True
            ).start()
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

    @property
    def failure(self) -> RankFailed | None:
        return self._failure

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._expect_exit:
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            self.fail(RankFailed(f"tensor-parallel rank {rank} (pid {proc.pid}) {how}"))

    def fail(self, failure: RankFailed) -> None:
        """The group is broken: kill the followers left, then tell the listeners (first failure only)."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure, listeners = failure, list(self._listeners)
        self._failed.set()
        self.kill()
        for listener in listeners:
            listener(failure)

    def on_failure(self, listener: Callable[[RankFailed], None]) -> None:
        """Call `listener(failure)` when the group fails (at once if it already has)."""
        with self._lock:
            failure = self._failure
            if failure is None:
                self._listeners.append(listener)
        if failure is not None:
            listener(failure)

    def failure_after(self, error: Exception, wait_s: float = 1.0) -> RankFailed:
        """The failure behind a collective that raised `error`: a dead rank's sockets close as it
        dies, so its watcher reports it within `wait_s`; otherwise (a timeout, a broken
        connection between live ranks) the group fails with `error` itself."""
        if not self._failed.wait(wait_s):
            self.fail(RankFailed(f"a collective with the other tensor-parallel ranks failed: {error}"))
        assert self._failure is not None
        return self._failure

    def wait_joined(self, store: dist.Store, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every follower is about to join the group; ModelConfigError if one exited first."""
        keys = [JOINED.format(rank) for rank in range(1, len(self.procs) + 1)]
        end = time.monotonic() + timeout_s
        while not store.check(keys):
            if self._failed.wait(0.05):
                raise ModelConfigError(f"{self._failure} at start-up")
            if time.monotonic() > end:
                raise ModelConfigError(f"tensor-parallel ranks did not start within {timeout_s:.0f}s")

    def expect_exit(self) -> None:
        """The followers are about to be told to stop: their exits are no longer failures."""
        self._expect_exit = True

    def join(self, timeout_s: float = 30.0) -> None:
        """Wait for the followers to exit (they were told to); kill the ones still running after."""
        self.expect_exit()
        end = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel follower %d did not exit; killing it", proc.pid)
        self.kill()

    def kill(self) -> None:
        self._expect_exit = True
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
