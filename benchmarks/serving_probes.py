"""What the serving benchmark (bench_serving.py) reads beside its load: the host's CPU, how often
the worker's engine holds no request while the load runs, py-spy profiles of the worker, and the
adapters each worker holds."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path


def host_cpu() -> str:
    """The host's CPU model and core count (Linux), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    except OSError:
        pass
    return platform.processor() or platform.machine()


@contextlib.contextmanager
def py_spy(pid: int, stem: Path, seconds: float, gil: bool = False) -> Iterator[None]:
    """py-spy samples process `pid` at 100 Hz for `seconds`, every thread, idle ones too, into
    collapsed stacks at stem.txt; with `gil` a second one samples only the thread holding the
    interpreter lock (stem.gil.txt: each thread's share of the lock). Waited for on leaving;
    nothing happens where py-spy is not installed."""
    spy = shutil.which("py-spy")
    if spy is None:
        yield
        return
    stem.parent.mkdir(parents=True, exist_ok=True)
    base = [spy, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))), "--rate", "100",
            "--format", "raw", "--threads", "--nonblocking"]  # fmt: skip
    runs = [[*base, "--idle", "--output", f"{stem}.txt"]]
    if gil:
        runs.append([*base, "--gil", "--output", f"{stem}.gil.txt"])
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT) for c in runs]
    try:
        yield
    finally:
        for proc in procs:
            proc.wait()


class EngineSampler:
    """How often the worker's engine holds no request at all (nothing running, nothing waiting)
    while the load runs: GetWorkerInfo every `interval_s` on a thread of its own, for `window_s`
    seconds from its start (the run's duration: after it a closed loop sends no more and the engine
    drains). At saturation an empty engine means requests are somewhere else (in transit, or
    finished and not yet seen)."""

    def __init__(self, address: str, window_s: float, interval_s: float = 0.02) -> None:
        self.address, self.window_s, self.interval_s = address, window_s, interval_s
        self.samples: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-sampler", daemon=True)

    def _run(self) -> None:
        from loraserve.clients.worker_client import WorkerClient

        end = time.monotonic() + self.window_s
        with WorkerClient(self.address, timeout=2) as client:
            while not self._stop.wait(self.interval_s) and time.monotonic() < end:
                with contextlib.suppress(Exception):  # a missed sample is no result
                    info = client.info()
                    self.samples.append((info.num_running, info.num_waiting))

    def __enter__(self) -> EngineSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float]:
        n = len(self.samples) or 1
        return {
            "samples": len(self.samples),
            "empty_share": round(sum(1 for r, w in self.samples if r + w == 0) / n, 4),
            "mean_running": round(sum(r for r, _ in self.samples) / n, 2),
            "mean_waiting": round(sum(w for _, w in self.samples) / n, 2),
        }


def holdings(addresses: Sequence[str]) -> dict[str, dict[str, str]]:
    """The adapters each worker holds now, from its ListAdapters: adapter id -> tier (a GPU
    slot's adapter as "gpu", whether or not the CPU tier also holds it; fetches in flight left out)."""
    from loraserve.clients.worker_client import WorkerClient
    from loraserve.v1 import worker_pb2

    tiers = {worker_pb2.ADAPTER_TIER_GPU: "gpu", worker_pb2.ADAPTER_TIER_CPU: "cpu"}
    out = {}
    for address in addresses:
        with WorkerClient(address, timeout=10) as client:
            listed = client.list_adapters()
        out[address] = {a.adapter_id: tiers[a.tier] for a in listed if a.tier in tiers}
    return out


def enter_all(stack: contextlib.ExitStack, contexts: Sequence[contextlib.AbstractContextManager]) -> None:
    """Enter each of `contexts` into `stack` (a run's probes, started as the run starts)."""
    for context in contexts:
        stack.enter_context(context)
