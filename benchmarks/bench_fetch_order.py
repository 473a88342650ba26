"""A request's adapter fetch started right behind a round of prefetches: how long it takes with the
worker's fetch order (adapters/fetch_gate.py: a fetch somebody waits for goes next) and without it
(every fetch sent to the fetch threads at once, taken in arrival order).

A store process (payloads on its disk tier) and the worker's fetcher over a StoreSource with its
fetch process, as the worker runs them. Each round starts `--behind` prefetches (no waiter) of
distinct adapters, then at once the fetch of another adapter that a request waits for, and times
that one to its end; rounds alternate between the two orders in one process.

    python benchmarks/bench_fetch_order.py [--behind 8] [--rounds 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_fetch_contention import SHAPES  # noqa: E402
from bench_store import store_with_adapters  # noqa: E402

from loraserve.inference_worker.adapters.fetcher import AdapterFetcher  # noqa: E402
from loraserve.inference_worker.adapters.metrics import AdapterMetrics  # noqa: E402
from loraserve.inference_worker.adapters.refs import AdapterRef  # noqa: E402
from loraserve.inference_worker.adapters.store_source import StoreSource  # noqa: E402


class Keep:
    """An installer that takes every payload (the benchmark times fetches, not the tiers)."""

    def generation(self, adapter_id: str) -> int:
        return 0

    def check(self, payload) -> None:  # type: ignore[no-untyped-def]
        pass

    def install(self, payload, generation: int) -> bool:  # type: ignore[no-untyped-def]
        return True


def measure(address: str, names: list[str], behind: int, rounds: int) -> dict[str, list[float]]:
    source = StoreSource(address, fetch_process=True, max_fetches=4)
    lock = threading.RLock()
    fetcher = AdapterFetcher(source, Keep(), lock, AdapterMetrics())
    gate = fetcher.gate
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fetcher.start(loop)
    times: dict[str, list[float]] = {"ordered": [], "arrival": []}
    cursor = 0
    try:
        for name in names[:4]:  # warm: the process, its connections, the segments
            with lock:
                flight = fetcher.fetch(AdapterRef(name), awaited=True)
            assert flight.future is not None
            flight.future.result(60)
        for r in range(2 * rounds):
            order = "ordered" if r % 2 == 0 else "arrival"
            fetcher.gate = gate if order == "ordered" else None
            picked = [names[(cursor + i) % len(names)] for i in range(behind + 1)]
            cursor += behind + 1
            with lock:
                flights = [fetcher.fetch(AdapterRef(n)) for n in picked[:-1]]  # the prefetches
                t0 = time.perf_counter()
                request = fetcher.fetch(AdapterRef(picked[-1]), waiter=r)
            assert request.future is not None
            request.future.result(120)
            times[order].append(time.perf_counter() - t0)
            for f in flights:
                assert f.future is not None
                f.future.result(120)
            print(f"{order}: {1e3 * times[order][-1]:.1f} ms", flush=True)
    finally:
        fetcher.gate = gate
        asyncio.run_coroutine_threadsafe(source.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    return times


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=tuple(SHAPES), default="1b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument(
        "--behind", type=int, default=8, help="prefetches started right before the request's fetch"
    )
    p.add_argument("--rounds", type=int, default=6, help="rounds of each order")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    config = SHAPES[args.shape]
    count = 2 * (args.behind + 1)  # a round never fetches what the round before fetched
    names = [f"a{i}" for i in range(count)]
    with store_with_adapters(config, names, args.rank, cache_max_adapters=1) as (_, address, payload_bytes):
        times = measure(address, names, args.behind, args.rounds)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    print(
        f"\na request's fetch right behind {args.behind} prefetches of {args.shape}-shaped rank-{args.rank} "
        f"adapters ({payload_bytes / 1e6:.1f} MB, the store's disk tier), 4 fetch threads; "
        f"{os.cpu_count()} CPUs, {device}"
    )
    print("| fetch order | the request's fetch: median (min-max) ms |")
    print("| --- | ---: |")
    for order, label in (("ordered", "a fetch somebody waits for goes next"), ("arrival", "arrival order")):
        t = times[order]
        print(f"| {label} | {1e3 * statistics.median(t):.1f} ({1e3 * min(t):.1f}-{1e3 * max(t):.1f}) |")
    if args.json:
        out = {
            "shape": args.shape,
            "rank": args.rank,
            "behind": args.behind,
            "payload_bytes": payload_bytes,
            "ms": {k: [round(1e3 * x, 2) for x in v] for k, v in times.items()},
            "cpus": os.cpu_count(),
            "device": device,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
