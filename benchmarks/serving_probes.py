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


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (Linux), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_s(pid: int) -> float:
    """CPU seconds of process `pid`, every thread's (ended ones too), to the nanosecond: the
    kernel's per-process CPU clock (/proc's counts are in 10 ms ticks, too coarse for one fetch)."""
    return time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def host_cpu() -> str:
    """The host's CPU model and core count."""
    return f"{cpu_model()} x {os.cpu_count()}"


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


def proc_stat(stat: Path) -> tuple[int, int, str]:
    """(parent pid, CPU ticks: utime + stime, state) from a /proc stat file."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[11]) + int(fields[12]), fields[0]


def child_pids(pid: int) -> list[int]:
    """The live (not ended) processes `pid` started, from /proc."""
    return children_of((pid,))[pid]


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    """Each of `parents` -> the live (not ended) processes it started, from one walk over /proc."""
    out: dict[int, list[int]] = {pid: [] for pid in parents}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):  # (gone meanwhile)
            ppid, _, state = proc_stat(stat)
            if ppid in out and state != "Z":
                out[ppid].append(int(stat.parent.name))
    return out


def _role(pid: int) -> str:
    """A short name for a process from its command line: the module or script it runs (with the
    subcommand of `loraserve.cli`: worker, store, ...)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "gone"
    for i, arg in enumerate(argv):
        if arg == "-m" and i + 1 < len(argv):
            module = argv[i + 1].rsplit(".", 1)[-1]
            return f"{module} {argv[i + 2]}" if module == "cli" and i + 2 < len(argv) else module
        if "spawn_main" in arg:
            return "generator"
        if arg.endswith(".py"):
            return Path(arg).stem
    return Path(argv[0]).name if argv and argv[0] else "?"


class ProcessCpu:
    """CPU time over a window, as shares of one core: the worker's process in all and its busiest
    threads (the first is its step thread under load; the interpreter they share cannot run more
    than one of them at a time), the processes it started (its stream front, its fetch process) and
    this benchmark's own child processes (the load generators). A share near 1.0 is what sets the
    pace. Linux only (/proc); elsewhere the summary is empty."""

    def __init__(self, worker_pid: int, window_s: float) -> None:
        self.worker_pid, self.window_s = worker_pid, window_s
        self._first: dict[str, int] = {}
        self._last: dict[str, int] = {}
        self._wall = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-cpu", daemon=True)

    def _snapshot(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with contextlib.suppress(OSError):
            out["worker"] = proc_stat(Path(f"/proc/{self.worker_pid}/stat"))[1]
            for task in Path(f"/proc/{self.worker_pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    out[f"worker thread {task.name}"] = proc_stat(task / "stat")[1]
        children = children_of((self.worker_pid, os.getpid()))
        for parent, name in ((self.worker_pid, "worker's"), (os.getpid(), "benchmark's")):
            for pid in children[parent]:
                if pid != self.worker_pid:
                    with contextlib.suppress(OSError):
                        out[f"{name} {_role(pid)} {pid}"] = proc_stat(Path(f"/proc/{pid}/stat"))[1]
        return out

    def _run(self) -> None:
        t0 = time.monotonic()
        self._first = self._snapshot()
        self._stop.wait(self.window_s)
        self._last = self._snapshot()
        self._wall = time.monotonic() - t0

    def __enter__(self) -> ProcessCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()  # a load that ended early (or failed) ends the window
        self._thread.join()

    def summary(self, threads: int = 3) -> dict[str, object]:
        if not self._wall or "worker" not in self._first:
            return {}
        hz = os.sysconf("SC_CLK_TCK")
        share = {
            k: round((v - self._first[k]) / hz / self._wall, 3)
            for k, v in self._last.items()
            if k in self._first
        }
        busiest = sorted((v for k, v in share.items() if k.startswith("worker thread")), reverse=True)
        out: dict[str, object] = {"worker": share.get("worker"), "worker_busiest_threads": busiest[:threads]}
        for k, v in sorted(share.items()):
            if not k.startswith("worker") or k.startswith("worker's"):
                name = k.rsplit(" ", 1)[0]  # several generator processes: their shares in a list
                out.setdefault(name, []).append(v)  # type: ignore[union-attr]
        return out


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
