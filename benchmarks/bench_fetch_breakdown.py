"""Where the time of one adapter fetch goes, store to worker: a store process on loopback (its CPU
cache of one adapter, so that fetching another sends the measured one to its disk tier) and the
worker's own fetch path (StoreSource, in its fetch process and in-process; streamed, and handed over
as a file through the store's hand-over directory on this host), against the parts of a
fetch measured alone in this process: the store's disk-tier read with its sha256, a bare stream
(messages received, not copied), the copy and hash of the receiving side, the worker's copy out of
shared memory, and sha256 on one thread.

    python benchmarks/bench_fetch_breakdown.py [--shape 1b] [--rank 16] [--repeats 9] [--json F]

Prints one table of medians (and the best run); a fetch from the disk tier is always the first of
its payload since the store last read it from disk.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_fetch_contention import SHAPES  # noqa: E402
from bench_store import store_with_adapters, times_of  # noqa: E402
from serving_probes import child_pids, cpu_model, cpu_s  # noqa: E402

from loraserve.adapter_store.payload_file import PayloadKey, open_payload  # noqa: E402
from loraserve.clients.adapter_fetch import AdapterDownload, _stream, fetch_adapter  # noqa: E402
from loraserve.clients.chunk_sink import ChunkSink  # noqa: E402
from loraserve.contract.chunk_codec import encode_chunk  # noqa: E402
from loraserve.inference_worker.adapters.store_source import CHANNEL_OPTIONS, StoreSource  # noqa: E402
from loraserve.inference_worker.fetching.process import FetchProcess  # noqa: E402

CHUNK = 1 << 20
T = TypeVar("T")


def summary(times: list[float]) -> tuple[float, float]:
    """(median, best) in ms."""
    return round(1e3 * statistics.median(times), 2), round(1e3 * min(times), 2)


def runs(fn: Callable[[], T], repeats: int, before: Callable[[], object] | None = None) -> list[T]:
    """What `fn()` returns in `repeats` runs after one warm-up run; `before` runs ahead of each."""
    out = []
    for i in range(repeats + 1):
        if before is not None:
            before()
        result = fn()
        if i:
            out.append(result)
    return out


def stream_parts(call, adapter_id: str) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """One bare stream (messages received, not copied): (seconds to the manifest, to the end)."""
    t0 = time.perf_counter()
    first = 0.0
    for _ in call(AdapterDownload(adapter_id).request()):
        if not first:
            first = time.perf_counter() - t0
    return first, time.perf_counter() - t0


def receive_parts(ch: grpc.Channel, adapter_id: str, dest: np.ndarray) -> tuple[float, float]:
    """One fetch as the fetch process makes it (fetch_adapter over a sync channel into a reused
    array), in this process: (seconds to the last chunk received, to the digest checked)."""
    download = AdapterDownload(adapter_id, allocate=lambda n: dest[:n])
    on_raw = download.on_raw
    last = [0.0]

    def timed_on_raw(raw: bytes) -> None:
        on_raw(raw)
        last[0] = time.perf_counter()

    download.on_raw = timed_on_raw  # type: ignore[method-assign]
    t0 = time.perf_counter()
    fetch_adapter(ch, adapter_id, download=download)
    return last[0] - t0, time.perf_counter() - t0


def sink_seconds(payload: bytes, dest: np.ndarray) -> float:
    """The receiving side's work alone: each 1 MiB chunk copied into a reused shared-memory
    segment and hashed (ChunkSink, as the fetch process runs it), chunks handed over at once."""
    n = len(payload)
    chunks = [payload[i : i + CHUNK] for i in range(0, n, CHUNK)]
    t0 = time.perf_counter()
    sink = ChunkSink()
    for i, c in enumerate(chunks):
        sink.put(dest[i * CHUNK : i * CHUNK + len(c)], c)
    sink.hexdigest()
    return time.perf_counter() - t0


def copy_out_seconds(payload: bytes, pin: bool) -> float:
    """The worker's copy of a payload out of shared memory into a buffer of its own."""
    mapped = mmap.mmap(-1, len(payload))
    mapped.write(payload)
    t0 = time.perf_counter()
    buffer = torch.empty(len(payload), dtype=torch.uint8, pin_memory=pin)
    buffer.copy_(torch.frombuffer(mapped, dtype=torch.uint8, count=len(payload)))
    seconds = time.perf_counter() - t0
    del buffer
    mapped.close()
    return seconds


def fetch_children() -> list[int]:
    """This process's adapter fetch process, if one runs."""
    kids = child_pids(os.getpid())
    found = []
    for p in kids:
        with contextlib.suppress(OSError):  # ended meanwhile
            if "fetching.child" in Path(f"/proc/{p}/cmdline").read_text():
                found.append(p)
    return found[:1]


def timed_copies(source: StoreSource) -> list[float]:
    """Seconds of each copy out of shared memory that `source`'s fetch process hands over, from now."""
    copies: list[float] = []
    process = source._process
    if process is not None:
        copy_out = process._copy_out

        def timed(segment: str, nbytes: int) -> torch.Tensor:
            t0 = time.perf_counter()
            try:
                return copy_out(segment, nbytes)
            finally:
                copies.append(time.perf_counter() - t0)

        process._copy_out = timed  # type: ignore[method-assign]
    return copies


def streams(address: str, size: int, repeats: int, rows: dict[str, list[float]]) -> None:
    """Bare streams, and fetches as the fetch process makes them, in this process."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        call, _ = _stream(ch)

        def evict() -> None:  # the store's one cache entry goes to "other"
            for _ in call(AdapterDownload("other").request()):
                pass

        dest = np.zeros(size, dtype=np.uint8)  # as a reused segment: its pages are there already
        for origin in ("memory", "disk"):
            before = evict if origin == "disk" else None
            bare = runs(lambda: stream_parts(call, "bench"), repeats, before)
            rows[f"bare stream, to the manifest ({origin})"] = [a for a, _ in bare]
            rows[f"bare stream, whole ({origin})"] = [b for _, b in bare]
            received = runs(lambda: receive_parts(ch, "bench", dest), repeats, before)
            rows[f"receiving side, to the last chunk ({origin})"] = [a for a, _ in received]
            rows[f"receiving side, to the digest checked ({origin})"] = [b for _, b in received]


async def settled(directory: Path, quiet_s: float = 0.05, limit_s: float = 5.0) -> None:
    """Until the store's background hand-over writes into `directory` have ended (no file being
    written for `quiet_s`): one that ended after the files were removed would put a file back."""
    deadline = time.monotonic() + limit_s
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        if any(f.name.startswith(".") for f in directory.iterdir()):
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return
        await asyncio.sleep(0.005)


async def worker_fetches(
    address: str, store_pid: int, repeats: int, rows: dict[str, list[float]], handover: Path
) -> None:
    """The worker's StoreSource, with its fetch process and without, streamed and handed over:
    each fetch's time, and the CPU time the store and the fetch process spent on it."""
    for path, in_process, shared in (
        ("fetch process", False, None),
        ("in-process", True, None),
        ("fetch process, hand-over", False, handover),
        ("in-process, hand-over", True, handover),
    ):
        source = StoreSource(address, fetch_process=not in_process, handover_dir=shared and str(shared))
        copies = timed_copies(source)
        try:
            # hand-over: the file written for the fetch from the store's memory, or already there
            # (handed over before); one in the disk tier streams to the fetch (its file is
            # written for the next)
            for origin in ("memory", "disk", "file there") if shared else ("memory", "disk"):
                times, cpu = [], []
                for i in range(repeats + 1):
                    if origin == "disk":
                        await source.fetch("other")
                    if shared and origin != "file there":
                        await settled(shared)
                        for f in shared.iterdir():
                            f.unlink()
                    pids = [store_pid, *fetch_children()] if i else []
                    c0 = [cpu_s(pid) for pid in pids]
                    t0 = time.perf_counter()
                    got = await source.fetch("bench")
                    streams = not shared or origin == "disk"
                    assert got.transport == ("stream" if streams else "file"), (path, origin, got.transport)
                    if i:
                        times.append(time.perf_counter() - t0)
                        cpu.append([cpu_s(pid) - c for pid, c in zip(pids, c0, strict=True)])
                rows[f"worker fetch, {path} ({origin})"] = times
                rows[f"  CPU of the store process ({path}, {origin})"] = [c[0] for c in cpu]
                if not in_process:
                    rows[f"  CPU of the fetch process ({path}, {origin})"] = [c[1] for c in cpu]
        finally:
            await source.close()
        if copies:
            rows["worker: copy out of shared memory (in the fetch)"] = copies[1:]


def parts_alone(tier_file: Path, size: int, repeats: int, rows: dict[str, list[float]]) -> None:
    """The store's and the receiving side's work on the payload, each alone in this process."""
    key = PayloadKey.from_file_name(tier_file.name)
    assert key is not None
    rows["store: disk tier read + sha256 (in this process)"] = times_of(
        lambda: open_payload(tier_file, key, size).read(), repeats
    )[0]
    rows["store: same, making the chunk messages"] = times_of(
        lambda: open_payload(tier_file, key, size).read(chunks=[], step=CHUNK), repeats
    )[0]
    payload = open_payload(tier_file, key, size).read().payload.numpy().tobytes()
    rows["store: encode the chunk messages from memory"] = times_of(
        lambda: [encode_chunk(o, memoryview(payload)[o : o + CHUNK]) for o in range(0, size, CHUNK)],
        repeats,
    )[0]
    rows["sha256, one thread"] = times_of(lambda: hashlib.sha256(payload).digest(), repeats)[0]
    if FetchProcess.supported():
        with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
            os.posix_fallocate(f.fileno(), 0, size)
            mapped = mmap.mmap(f.fileno(), size)
            segment = np.frombuffer(mapped, dtype=np.uint8)
            segment[:] = 0  # as a reused segment: its pages are mapped already
            rows["receiving side alone: copy into shared memory + sha256 (ChunkSink)"] = [
                sink_seconds(payload, segment) for _ in range(repeats)
            ]
            del segment
            mapped.close()
    pin = torch.cuda.is_available()
    rows[f"worker: copy out of shared memory{' (pinned)' if pin else ''}, alone"] = [
        copy_out_seconds(payload, pin) for _ in range(repeats)
    ]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=tuple(SHAPES), default="1b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    config = SHAPES[args.shape]
    rows: dict[str, list[float]] = {}
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    # the store's disk tier (read again after it stops), and its hand-over directory
    with tempfile.TemporaryDirectory() as tier, tempfile.TemporaryDirectory(dir=shm) as shared:
        handover = Path(shared) / "handover"
        with store_with_adapters(
            config,
            ["bench", "other"],
            args.rank,
            cache_max_adapters=1,
            cache_dir=Path(tier),
            extra=["--handover-dir", str(handover)],
        ) as (store, address, size):
            streams(address, size, args.repeats, rows)
            asyncio.run(worker_fetches(address, store.pid, args.repeats, rows, handover))
        parts_alone(next(Path(tier).glob("bench@*.payload")), size, args.repeats, rows)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"\none fetch of a {args.shape}-shaped rank-{args.rank} adapter (all seven modules, {size / 1e6:.1f} MB), "
          f"store process on loopback; {cpu_model()}, {os.cpu_count()} CPUs, {device}; "
          f"grpcio {grpc.__version__}; {args.repeats} runs after a warm-up")  # fmt: skip
    print("| part | median ms | best ms |\n| --- | ---: | ---: |")
    for name, times in rows.items():
        median, best = summary(times)
        print(f"| {name} | {median} | {best} |")
    if args.json:
        out = {"shape": args.shape, "rank": args.rank, "payload_bytes": size, "cpu": cpu_model(),
               "cpus": os.cpu_count(), "device": device, "grpcio": grpc.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "ms": {name: [round(1e3 * t, 3) for t in times] for name, times in rows.items()}}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
