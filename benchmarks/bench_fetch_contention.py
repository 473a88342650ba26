"""How long one adapter fetch takes in the worker, alone and beside a busy interpreter: the
worker's StoreSource fetching in its own process (threads) against in its fetch process, from a
store process on loopback. "Busy" is what serving load does to the worker's interpreter lock: a
thread making short torch calls between Python work (the step thread) and a thread running Python
most of the time (the gRPC event loop), both taking the lock over and over.

    python benchmarks/bench_fetch_contention.py [--shape 1b] [--repeats 15] [--json F]

Prints a table: median and p90 ms of a fetch by path and load, and the in-process / process ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
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

from bench_store import LLAMA3_8B, store_with_adapters  # noqa: E402
from serving_fleet import SHAPES as SERVING_SHAPES  # noqa: E402

from loraserve.inference_worker.adapters.store_source import StoreSource  # noqa: E402
from loraserve.inference_worker.model.tiny import llama_config  # noqa: E402

_1B = SERVING_SHAPES["1b"]  # the serving benchmark's model: the adapter payloads its workers fetch
# (token ids play no part in an adapter's shape)
SHAPES = {"1b": llama_config(_1B, _1B.vocab_size, bos_id=1, eos_id=2), "8b": LLAMA3_8B}


class Busy:
    """Threads that keep the interpreter lock busy, as a serving worker's do."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._step_like, daemon=True),
            threading.Thread(target=self._loop_like, daemon=True),
        ]

    def _step_like(self) -> None:
        x = torch.zeros(16)
        while not self.stop.is_set():
            for _ in range(30):
                x.add_(1)  # each torch call lets go of the lock and takes it back
            total = 0
            for i in range(3000):
                total += i

    def _loop_like(self) -> None:
        while not self.stop.is_set():
            total = 0
            for i in range(20000):
                total += i
            time.sleep(0.0002)

    def __enter__(self) -> Busy:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


async def timed_fetches(source: StoreSource, repeats: int, disk: bool = False) -> list[float]:
    """`repeats` fetch times of "bench"; with `disk`, each after one of "other", which takes the
    store's single cache entry: every timed fetch then streams from the store's disk tier."""
    await source.fetch("bench")  # warm: connection, process, segment
    times = []
    for _ in range(repeats):
        if disk:
            await source.fetch("other")
        t0 = time.perf_counter()
        await source.fetch("bench")
        times.append(time.perf_counter() - t0)
    return times


def hash_floor(nbytes: int, repeats: int = 5) -> dict[str, float]:
    """The best of `repeats` sha256 passes over `nbytes` on one thread: the payload's digest is
    checked on the receiving side, so no fetch of it can end sooner."""
    data = os.urandom(nbytes)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        hashlib.sha256(data).hexdigest()
        best = min(best, time.perf_counter() - t0)
    return {"sha256_ms": round(best * 1e3, 2), "sha256_gb_s": round(nbytes / best / 1e9, 2)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=tuple(SHAPES), default="1b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--rounds", type=int, default=2, help="each case this many times, interleaved")
    p.add_argument("--switch-interval-ms", type=float, default=0.5, help="as the worker sets it")
    p.add_argument(
        "--origin",
        choices=("memory", "disk"),
        default="memory",
        help="where the store finds the payload: its CPU cache, or its disk tier (cache of one adapter)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    config = SHAPES[args.shape]
    cache = 1 if args.origin == "disk" else None
    with store_with_adapters(
        config, ["bench", "other"], args.rank, first_seed=7, cache_max_adapters=cache
    ) as (_, address, payload_bytes):
        results: dict[str, list[float]] = {}

        async def measure() -> None:
            sources = {
                "in-process": StoreSource(address, fetch_process=False),
                "fetch process": StoreSource(address, fetch_process=True),
            }
            try:
                for _ in range(args.rounds):
                    for name, source in sources.items():
                        for load in ("alone", "busy"):
                            with Busy() if load == "busy" else contextlib.nullcontext():
                                times = await timed_fetches(source, args.repeats, args.origin == "disk")
                            results.setdefault(f"{name}|{load}", []).extend(times)
            finally:
                for source in sources.values():
                    await source.close()

        asyncio.run(measure())
    rows = {}
    for key, times in results.items():
        times = sorted(times)
        rows[key] = {
            "median_ms": round(1e3 * statistics.median(times), 2),
            "p90_ms": round(1e3 * times[math.ceil(0.9 * len(times)) - 1], 2),  # nearest rank
            "n": len(times),
        }
    print(f"\nfetch of one {args.shape}-shaped rank-{args.rank} adapter (all seven modules) from the store's {args.origin}, "
          f"switch interval {args.switch_interval_ms} ms, {platform.node()}")  # fmt: skip
    print("| path | load | median ms | p90 ms |")
    print("| --- | --- | ---: | ---: |")
    for key, row in rows.items():
        name, load = key.split("|")
        print(f"| {name} | {load} | {row['median_ms']} | {row['p90_ms']} |")
    for load in ("alone", "busy"):
        a, b = rows[f"in-process|{load}"]["median_ms"], rows[f"fetch process|{load}"]["median_ms"]
        print(f"{load}: in-process / fetch process = {a / b:.2f}x")
    floor = hash_floor(payload_bytes)
    print(f"sha256 of the {payload_bytes / 1e6:.1f} MB payload on this host, one thread: {floor['sha256_ms']} ms "
          f"({floor['sha256_gb_s']} GB/s): a fetch's floor, however it streams")  # fmt: skip
    if args.json:
        out = {"shape": args.shape, "rank": args.rank, "origin": args.origin, "rows": rows, "hash_floor": floor,
               "switch_interval_ms": args.switch_interval_ms, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
