"""bench_serving.py's command line: the data, the sweep, the two-worker prefetch runs, variants."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def length_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--workdir", default="/tmp/loraserve-serving-bench", type=Path)
    p.add_argument("--shape", choices=("1b", "tiny"), default="1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-adapters", type=int, default=1000)
    p.add_argument("--ns", default="5,100,1000", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--prompt-len", type=length_range, default=(64, 256))
    p.add_argument("--output-len", type=length_range, default=(32, 128))
    p.add_argument("--max-loras", type=int, default=64)
    p.add_argument("--max-cpu-loras", type=int, default=256)
    p.add_argument("--store-cache", type=int, default=128, help="adapters the store keeps optimized")
    p.add_argument(
        "--store-handover-dir",
        default="",
        help="the store's --handover-dir (a worker variant with --store-handover-dir DIR takes payloads "
        "as files there; workers without it stream)",
    )
    p.add_argument(
        "--store-handover-max-bytes", type=int, default=4 << 30, help="the store's --handover-max-bytes"
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-cache-mb", type=int, default=8192)
    p.add_argument("--lookahead", type=int, default=16)
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of load before each N's runs")
    p.add_argument("--first-warmup", type=float, default=30.0, help="seconds of load before the first N's")
    p.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="seconds of each further warm-up period, run while the share of requests whose adapter "
        "comes from the store keeps falling (0 = off): slots that hold every adapter fill before the "
        "measured runs",
    )
    p.add_argument(
        "--max-warmup", type=float, default=120.0, help="with --settle: warm-up seconds per N in all"
    )
    p.add_argument("--duration", type=float, default=15.0, help="seconds per measured run")
    p.add_argument(
        "--gen-processes",
        type=int,
        default=2,
        help="load generator processes of the N sweep (one event loop reads ~40k streamed messages a "
        "second; one was near its limit at ~290 req/s); the two-worker runs use one, the router's "
        "choices being its own",
    )
    p.add_argument(
        "--connections",
        type=positive,
        default=1,
        help="connections to each worker per generator process, taken in turn (a worker with several "
        "front processes gets each connection on one of them)",
    )
    p.add_argument("--prefetch", type=int, default=32, help="adapters prefetched per round when on")
    p.add_argument("--prefetch-duration", type=float, default=15.0, help="0 = skip the two-worker runs")
    p.add_argument(
        "--prefetch-warmup",
        type=float,
        default=120.0,
        help="seconds of saturating load through the router over both workers before the measured "
        "phase (a few thousand requests: under Zipf over 1,000 adapters, fewer leave most of the "
        "tail never seen)",
    )
    p.add_argument(
        "--prefetch-variants",
        default=("off", "on"),
        type=lambda s: tuple(v for v in s.split(",") if v in ("off", "on")) or ("off", "on"),
        help="which two-worker runs, in order: off,on (default), off or on",
    )
    p.add_argument("--prefetch-rate", type=float, default=0.0, help="req/s (default: half of saturation)")
    p.add_argument("--redis-url", default="", help="an existing Redis (else --redis-server is started)")
    p.add_argument("--redis-server", default="redis-server", help="redis-server binary to start")
    p.add_argument("--redis-prefix", default="loraserve-bench:")
    p.add_argument("--processes", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    p.add_argument("--json", default=None)
    p.add_argument(
        "--sweep",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the N sweep (else prefetch only)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        type=lambda v: tuple(v.split("=", 1)) if "=" in v else (v, ""),
        help="NAME=WORKER_FLAGS: the N sweep again on a worker started with these extra flags",
    )
    p.add_argument(
        "--variant-tree",
        action="append",
        default=[],
        type=lambda v: tuple(v.split("=", 1)) if "=" in v else (Path(v).name, v),
        help="NAME=DIR: the N sweep again on a worker run from the checkout DIR (another commit of "
        "this repository, e.g. from `git worktree add`), with the same store, adapters and flags",
    )
    p.add_argument("--profile", type=Path, default=None, help="py-spy the worker into this folder")
    p.add_argument("--profile-gil", action="store_true", help="with --profile: the lock holder's too")
    return p
