"""What a call costs the step thread when another thread wants the interpreter: each call timed in
a loop while a thread spins in Python beside it (as the worker's event loop does under load). A
call that lets the interpreter go (an event's synchronize, record or wait, a copy, a graph replay,
numpy's copies) waits to get it back for up to the switch interval; one that keeps it (an event's
query, a copy through memoryviews) does not. The CUDA rows run on an idle device, so they price the
call's host side (rows marked "settled" include polling until the device is idle again). benchmarks/results/serving.md, 2026-11-28 14:20 UTC.

    python benchmarks/bench_handover.py [--switch-interval-ms 0.5] [--calls 200] [--json out.json]

Without CUDA the event rows are left out."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - t0) / calls


def rows(calls: int) -> dict[str, float]:
    cuda = torch.cuda.is_available()
    host = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=cuda)
    src = torch.arange(4096, dtype=torch.int64)  # 32 KB, a large step's packed inputs
    staged, raw = host.numpy(), src.numpy().view(np.uint8)
    view, raw_view = staged.data, src.numpy().data.cast("B")
    out = {
        "numpy slice copy, 32 KB": per_call_us(lambda: staged.__setitem__(slice(0, raw.size), raw), calls),
        "memoryview slice copy, 32 KB": per_call_us(
            lambda: view.__setitem__(slice(0, raw_view.nbytes), raw_view), calls
        ),
    }
    if cuda:
        out.update(cuda_rows(host, calls))
    return out


def cuda_rows(host: torch.Tensor, calls: int) -> dict[str, float]:
    """The CUDA calls a step makes, each on an idle device (so only the call's host side counts)."""
    dev = torch.device("cuda")
    stream = torch.cuda.current_stream(dev)
    done = torch.cuda.Event()
    done.record()
    dst = torch.empty(host.numel(), dtype=torch.uint8, device=dev)
    parts_src = [torch.zeros(1024, device=dev) for _ in range(8)]
    parts_dst = [torch.empty(1024, device=dev) for _ in range(8)]
    static = torch.zeros(64, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.add_(1)
    torch.cuda.synchronize()

    def settle(fn: Callable[[], object]) -> Callable[[], object]:  # keep the device idle
        def call() -> object:
            out = fn()
            done.record(stream)
            while not done.query():
                pass
            return out

        return call

    return {
        "event query (done)": per_call_us(done.query, calls),
        "event synchronize (done)": per_call_us(done.synchronize, calls),
        "event record": per_call_us(lambda: done.record(stream), calls),
        "stream wait_event (done)": per_call_us(lambda: stream.wait_event(done), calls),
        "64 KB host-to-device copy, async (settled)": per_call_us(
            settle(lambda: dst.copy_(host, non_blocking=True)), calls
        ),
        "_foreach_copy_ of 8 tensors (settled)": per_call_us(
            settle(lambda: torch._foreach_copy_(parts_dst, parts_src)), calls
        ),
        "graph replay, one kernel (settled)": per_call_us(settle(graph.replay), calls),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--switch-interval-ms", type=float, default=0.5, help="the worker's default")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    sys.setswitchinterval(a.switch_interval_ms / 1e3)
    alone = rows(a.calls)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    time.sleep(0.05)
    try:
        beside = rows(a.calls)
    finally:
        stop.set()
        spinner.join()
    print(f"{'call':34s} {'alone us':>10s} {'beside a spinning thread us':>28s}")
    for name, us in beside.items():
        print(f"{name:34s} {alone[name]:10.1f} {us:28.1f}")
    if a.json is not None:
        a.json.write_text(
            json.dumps({"switch_interval_ms": a.switch_interval_ms, "alone": alone, "beside": beside})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
