"""Adapter fetches that overlap: how the store process and the worker's fetch process share them.

Under serving load at 1,000 adapters a worker fetches ~40 adapters a second, several at once; a
store-tier request's time to first token is its fetch's. This starts a store process (payloads
found on its disk tier, or in its memory) and a worker's StoreSource with its fetch process, then
fetches k distinct adapters at once for k = 1, 2, 4, 8: per k the wall time of the k fetches, each
fetch's time, the aggregate rate, and the CPU time the store process and the fetch process spent
per fetch (from /proc). A path that scales keeps each fetch's time near k = 1's while the rate grows.

    python benchmarks/bench_fetch_concurrency.py [--origin disk|memory] [--ks 1,2,4,8] [--rounds 6]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_fetch_contention import SHAPES  # noqa: E402
from bench_store import store_with_adapters  # noqa: E402
from serving_probes import child_pids, cpu_s  # noqa: E402

from loraserve.inference_worker.adapters.store_source import StoreSource  # noqa: E402


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of `pid` (utime + stime, in /proc's 10 ms ticks: the kernel's
    per-thread CPU clocks answer only for the caller's own threads)."""
    out = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(stat.parent.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def busiest_ms(before: dict[int, float], after: dict[int, float], fetches: int) -> float:
    """CPU ms per fetch of the thread that spent the most: a thread that does a serial share of
    every fetch caps the rate at 1 / this."""
    return round(1e3 * max((after[t] - before.get(t, 0.0) for t in after), default=0.0) / fetches, 1)


def nearest_rank(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[max(0, math.ceil(q * len(values)) - 1)]


async def measure(address: str, names: list[str], ks: list[int], rounds: int, store_pid: int) -> list[dict]:
    source = StoreSource(address, fetch_process=True, max_fetches=max(ks))
    try:
        for name in names[:2]:
            await source.fetch(name)  # warm: connection, process, segments
        kids = [
            p for p in child_pids(os.getpid()) if "fetching.child" in Path(f"/proc/{p}/cmdline").read_text()
        ]
        if not kids:
            raise RuntimeError("no fetch process: shared memory unavailable?")
        child = kids[0]
        rows, cursor = [], 0
        for k in ks:
            walls, each = [], []
            s0, c0 = cpu_s(store_pid), cpu_s(child)
            st0, ct0 = thread_cpu_s(store_pid), thread_cpu_s(child)
            for _ in range(rounds):
                picked = [names[(cursor + j) % len(names)] for j in range(k)]
                cursor += k

                async def one(name: str) -> float:
                    t = time.perf_counter()
                    await source.fetch(name)
                    return time.perf_counter() - t

                t0 = time.perf_counter()
                each.extend(await asyncio.gather(*(one(n) for n in picked)))
                walls.append(time.perf_counter() - t0)
            fetches = k * rounds
            rows.append(
                {
                    "k": k,
                    "wall_ms": round(1e3 * statistics.median(walls), 1),
                    "fetch_median_ms": round(1e3 * statistics.median(each), 1),
                    "fetch_p90_ms": round(1e3 * nearest_rank(each, 0.9), 1),
                    "fetches_per_s": round(k / statistics.median(walls), 1),
                    "store_cpu_ms_per_fetch": round(1e3 * (cpu_s(store_pid) - s0) / fetches, 1),
                    "fetch_process_cpu_ms_per_fetch": round(1e3 * (cpu_s(child) - c0) / fetches, 1),
                    "store_busiest_thread_ms_per_fetch": busiest_ms(st0, thread_cpu_s(store_pid), fetches),
                    "fetch_process_busiest_thread_ms_per_fetch": busiest_ms(
                        ct0, thread_cpu_s(child), fetches
                    ),
                }
            )
            print(rows[-1], flush=True)
        return rows
    finally:
        await source.close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=tuple(SHAPES), default="1b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--origin", choices=("disk", "memory"), default="disk")
    p.add_argument("--ks", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    config = SHAPES[args.shape]
    count = 2 * max(ks)  # distinct adapters: a round never fetches one the round before fetched
    names = [f"a{i}" for i in range(count)]
    cache = 1 if args.origin == "disk" else count + 1
    with store_with_adapters(config, names, args.rank, cache_max_adapters=cache) as (
        store,
        address,
        payload_bytes,
    ):
        rows = asyncio.run(measure(address, names, ks, args.rounds, store.pid))
    host = platform.node()
    print(f"\n{count} distinct {args.shape}-shaped rank-{args.rank} adapters ({payload_bytes / 1e6:.1f} MB), "
          f"found on the store's {args.origin}; {os.cpu_count()} CPUs, {host}")  # fmt: skip
    print(
        "| fetches at once | wall ms | each: median / p90 ms | fetches/s | CPU ms a fetch: store (busiest thread) | fetch process (busiest thread) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['k']} | {r['wall_ms']} | {r['fetch_median_ms']} / {r['fetch_p90_ms']} | {r['fetches_per_s']} | "
              f"{r['store_cpu_ms_per_fetch']} ({r['store_busiest_thread_ms_per_fetch']}) | "
              f"{r['fetch_process_cpu_ms_per_fetch']} ({r['fetch_process_busiest_thread_ms_per_fetch']}) |")  # fmt: skip
    if args.json:
        out = {"shape": args.shape, "rank": args.rank, "origin": args.origin, "payload_bytes": payload_bytes,
               "rows": rows, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
