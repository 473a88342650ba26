"""What serving one streamed token costs the worker's host, without a GPU.

A real worker process (gRPC service, engine, scheduler, detokenizer; `loraserve worker` on a tiny
model) whose runner answers fixed logits instead of calling the model, as in bench_host_step.py:
the device's share of a step is gone and what is left is the host work a GPU worker does around
it. The load generator (`loraserve bench`'s runner, closed loop) runs in this process on another
core. Reported: the worker's CPU time per streamed token, split into its step thread and the rest
(the event loop that streams, gRPC's threads), and that of the processes it started (the
`--stream-process` front), read from /proc, and the client's CPU share (when it nears 1.0 the
client, not the worker, sets the rate); and from the worker's metrics its garbage collections and
how full its steps were. The worker's processes share the cores the client leaves. `--step-ms`
makes each model call also take that long with the interpreter free, as a GPU step does: the
pipeline around an engine whose steps take a GPU's time. `--hold-ms` makes each model call first
run Python for that long on the step thread, as a GPU worker's launches do: an interpreter that the
step thread keeps busy, with the event loop getting what is left.

`--adapters N` serves N distinct adapters of the tiny model (ranks 8 and 16, all seven modules;
written once under `--adapter-dir`) from a real store process on the client's core, Zipf popular,
through `--max-loras` slots and a CPU tier of `--max-cpu-loras`: with N above both, the worker
fetches, loads into slots and evicts continuously, as a GPU worker serving a thousand adapters
does (its slot copies are CPU copies here).

    python benchmarks/bench_host_serving.py [--concurrency 64] [--output-len 64 | LO:HI] [--duration 8]
        [--step-ms 2.4] [--hold-ms 1.5] [--worker-arg=--stream-interval=4 ...] [--json out.json]
        [--adapters 1000 [--max-loras 32] [--max-cpu-loras 64] [--zipf 1.0] [--handover]]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serving_fleet import LISTENING, Fleet, register_all, write_adapters  # noqa: E402
from serving_probes import child_pids, proc_stat  # noqa: E402

from loraserve.clients.bench.cli import length_range  # noqa: E402
from loraserve.clients.bench.runner import RunLimits, run_benchmark  # noqa: E402
from loraserve.clients.bench.targets import Sampling, WorkerTarget  # noqa: E402
from loraserve.clients.bench.workload import RequestStream, WorkloadSpec  # noqa: E402

# the worker's process: the runner answers fixed logits (bench_host_step's); the step thread's
# native id is written to a file so its CPU time can be told apart from the rest of the process
CHILD = """
import sys, threading, time
from collections.abc import Sequence
from pathlib import Path
from benchmarks.bench_host_step import fixed_logits_run
from loraserve.inference_worker.engine import engine, model_runner
from loraserve.inference_worker.server import main

STEP_S, HOLD_S = (float(ms) / 1e3 for ms in sys.argv[2].split(","))

def run(runner, plan, prev_tokens=None):
    out = fixed_logits_run(runner, plan, prev_tokens)
    if HOLD_S:  # the host work of a GPU step's launches: Python on the step thread
        end = time.perf_counter() + HOLD_S
        while time.perf_counter() < end:
            pass
    if STEP_S:  # a device step: the interpreter is free meanwhile, as while a GPU step runs
        time.sleep(STEP_S)
    return out

model_runner.ModelRunner.run = run
_loop = engine.LLMEngine._loop

def loop(self):
    Path(sys.argv[1]).write_text(str(threading.get_native_id()))
    _loop(self)

engine.LLMEngine._loop = loop
sys.exit(main(sys.argv[3:]))
"""


def cpu_ticks(pid: int, tid: int | None = None) -> int:
    return proc_stat(Path(f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"))[1]


def children_ticks(pid: int) -> int:
    """CPU ticks of the processes `pid` started (a `--stream-process` front, the fetch process)."""
    total = 0
    for child in child_pids(pid):
        with contextlib.suppress(OSError):  # gone meanwhile
            total += cpu_ticks(child)
    return total


async def drive(
    address: str,
    args: argparse.Namespace,
    duration: float,
    metrics: Sequence[str] = (),
    adapter_ids: Sequence[str] = (),
) -> tuple[dict, float]:
    """(the run's summary, with the worker's activity from `metrics`; this process's CPU share)"""
    target = WorkerTarget(address, Sampling())
    await target.start()
    vocab = await target.vocab_size()
    spec = WorkloadSpec(
        vocab_size=vocab or 32000,
        adapter_ids=tuple(adapter_ids),
        popularity="zipf",
        zipf_exponent=args.zipf,
        base_share=args.base_share if adapter_ids else 1.0,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        rate=None,
        seed=1,
    )
    limits = RunLimits(None, duration, concurrency=args.concurrency, open_loop=False)
    cpu0 = time.process_time()
    got = await run_benchmark(
        target, RequestStream(spec), limits, metrics_urls=metrics, progress_interval_s=None,
        progress_out=io.StringIO(),
    )  # fmt: skip
    cpu = time.process_time() - cpu0
    await target.close()
    return got.summary, cpu / max(float(got.summary["duration_s"]), 1e-9)  # type: ignore[arg-type]


def pin_threads(pid: int, cores: set[int]) -> None:
    """Every thread of process `pid` onto `cores` (each thread has a mask of its own); a process or
    thread that ended meanwhile is skipped."""
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task.name), cores)


def start_store(
    args: argparse.Namespace, model: Path, tmp: Path, fleet: Fleet, core: int
) -> tuple[list[str], list[str]]:
    """With --adapters: a store process on `core` with the adapters registered; (their ids, the
    worker's flags that serve them)."""
    ids = write_adapters(
        args.adapter_dir, model, args.adapters, processes=max(1, len(os.sched_getaffinity(0)))
    )
    handover = str(tmp / "handover") if args.handover else ""
    store = fleet.start_store(
        model, args.adapter_dir, cache_adapters=args.max_cpu_loras, dtype="float32", handover_dir=handover
    )
    pin_threads(store.process.pid, {core})
    register_all(store.address, args.adapter_dir, ids)
    if args.unknown_every > 0:  # (never registered: each request for one fetches and fails)
        k = args.unknown_every
        ids = [f"unknown-{i:04d}" if i % k == k - 1 else aid for i, aid in enumerate(ids)]
    flags = [
        "--store-address", store.address, "--max-loras", str(args.max_loras),
        "--max-cpu-loras", str(args.max_cpu_loras), "--max-lora-rank", "16",
        *(["--store-handover-dir", handover] if handover else []),
    ]  # fmt: skip
    return ids, flags


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--output-len", type=length_range, default=(64, 64), help="N or LO:HI (uniform)")
    p.add_argument("--prompt-len", type=length_range, default=(32, 32), help="N or LO:HI (uniform)")
    p.add_argument(
        "--step-ms", type=float, default=0.0, help="each model call also waits this long (a GPU step's time)"
    )
    p.add_argument(
        "--hold-ms", type=float, default=0.0, help="each model call also runs Python this long (host work)"
    )
    p.add_argument(
        "--worker-alone",
        action="store_true",
        help="the worker's own process alone on its cores, the processes it started on the client's",
    )
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before measuring")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--worker-arg", action="append", default=[], help="extra `loraserve worker` flag")
    p.add_argument("--adapters", type=int, default=0, help="distinct adapters served (0: the base model)")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the adapters' popularity")
    p.add_argument("--base-share", type=float, default=0.0, help="with --adapters: share of base requests")
    p.add_argument("--max-loras", type=int, default=32, help="with --adapters: the worker's slots")
    p.add_argument("--max-cpu-loras", type=int, default=64, help="with --adapters: its CPU tier")
    p.add_argument(
        "--adapter-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "loraserve-host-serving-adapters",
        help="where the adapters are written (kept: a later run reuses them)",
    )
    p.add_argument(
        "--unknown-every",
        type=int,
        default=0,
        help="with --adapters: every Nth adapter in popularity order is one the store does not hold (its "
        "requests fail NOT_FOUND after a fetch: the failure path)",
    )
    p.add_argument("--handover", action="store_true", help="with --adapters: payloads handed over as files")
    p.add_argument("--json", default=None)
    p.add_argument("--profile", default=None, help="py-spy raw samples of the worker, to this file")
    args = p.parse_args()

    from loraserve.inference_worker.model.tiny import TinyLlamaSpec, write_tiny_llama

    cores = sorted(os.sched_getaffinity(0))
    client_core, worker_cores = cores[0], cores[1:] or cores
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_llama(Path(tmp) / "model", TinyLlamaSpec())
        tid_file = Path(tmp) / "step-thread"
        fleet = Fleet(Path(tmp))
        ids, store_flags = (
            start_store(args, model, Path(tmp), fleet, client_core) if args.adapters else ([], [])
        )
        cmd = [
            sys.executable, "-c", CHILD, str(tid_file), f"{args.step_ms},{args.hold_ms}",
            "--model", str(model), "--device", "cpu", "--port", "0", "--log-level", "WARNING",
            "--max-num-seqs", str(args.max_num_seqs), "--max-queue-size", str(4 * args.concurrency),
            "--max-num-batched-tokens", "8192", "--kv-cache-mb", "512", "--metrics-port", "0",
            *store_flags, *args.worker_arg,
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=str(ROOT), stdout=subprocess.PIPE, text=True)
        try:
            os.sched_setaffinity(proc.pid, set(worker_cores))
            assert proc.stdout is not None
            line = proc.stdout.readline()  # "worker ... listening on host:port (metrics on host:port)"
            found = LISTENING.search(line)
            if found is None or found.group(3) is None:
                raise RuntimeError(f"the worker did not start: {line!r}")
            address, metrics = f"{found.group(1)}:{found.group(2)}", f"{found.group(3)}:{found.group(4)}"
            os.sched_setaffinity(0, {client_core})
            if args.worker_alone:  # its front and fetch processes beside the client instead
                for child in child_pids(proc.pid):
                    pin_threads(child, {client_core})
            asyncio.run(drive(address, args, args.warmup, adapter_ids=ids))
            step_tid = int(tid_file.read_text())
            spy = None
            if args.profile:  # py-spy at 100 Hz, native frames off: the Python of both threads
                spy = subprocess.Popen(
                    ["py-spy", "record", "-p", str(proc.pid), "-r", "100", "-d", str(int(args.duration)),
                     "-f", "raw", "-o", args.profile],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
            w0, s0, c0 = cpu_ticks(proc.pid), cpu_ticks(proc.pid, step_tid), children_ticks(proc.pid)
            t0 = time.perf_counter()
            summary, client_share = asyncio.run(drive(address, args, args.duration, [metrics], ids))
            w1, s1, c1 = cpu_ticks(proc.pid), cpu_ticks(proc.pid, step_tid), children_ticks(proc.pid)
            wall = time.perf_counter() - t0
            if spy is not None:
                spy.wait(60)
        finally:
            proc.terminate()
            proc.wait(30)
            fleet.close()
    hz = os.sysconf("SC_CLK_TCK")
    activity: dict = summary["adapter_activity"]  # type: ignore[assignment]
    tokens = int(summary["total_output_tokens"])  # type: ignore[call-overload]
    if not tokens:
        raise RuntimeError(f"no tokens were streamed: {summary}")
    row = {
        "worker_args": " ".join(args.worker_arg),
        "concurrency": args.concurrency,
        "output_len": list(args.output_len),
        "step_ms": args.step_ms,
        "hold_ms": args.hold_ms,
        "worker_alone": args.worker_alone,
        "adapters": args.adapters,
        **(
            {
                "max_loras": args.max_loras,
                "max_cpu_loras": args.max_cpu_loras,
                "zipf": args.zipf,
                "unknown_every": args.unknown_every,
                "handover": args.handover,
            }
            if args.adapters
            else {}
        ),  # fmt: skip
        "requests_per_s": summary["request_throughput"],
        "tokens_per_s": summary["output_token_throughput"],
        "failed": summary["failed"],
        "errors": summary.get("errors", {}),
        "worker_cpu_share": round((w1 - w0) / hz / wall, 3),
        "worker_us_per_token": round(1e6 * (w1 - w0) / hz / tokens, 1),
        "step_thread_us_per_token": round(1e6 * (s1 - s0) / hz / tokens, 1),
        "rest_us_per_token": round(1e6 * ((w1 - w0) - (s1 - s0)) / hz / tokens, 1),
        "children_cpu_share": round((c1 - c0) / hz / wall, 3),
        "children_us_per_token": round(1e6 * (c1 - c0) / hz / tokens, 1),
        "client_cpu_share": round(client_share, 3),
        # from the worker's metrics over the measured run: its garbage collections (by generation,
        # their total ms) and how full its steps were
        **{
            k: activity[k]
            for k in ("gc_collections", "gc_ms", "gc_cpu_ms", "gc_over_10ms", "mean_sequences_per_step")
        },
        # adapters fetched (cpu) and copied into slots (gpu), and evicted, by tier
        **{k: activity[k] for k in ("loads", "failed_loads", "evictions")},
        # what ended the steps' admission passes, and how long requests were outside the engine
        "step_admissions": activity["step_admissions"],
        "outside_engine_ms": summary.get("outside_engine_ms"),
        "mean_requests_outside_engine": summary.get("mean_requests_outside_engine"),
    }
    print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
