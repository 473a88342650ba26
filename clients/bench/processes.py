"""One request stream driven from several processes, so the generator is not what limits a fast
target: one Python event loop reads a few tens of thousands of streamed messages a second.

Process k of P takes the stream's requests whose index is k modulo P, each with its own target
(its own connections) and its own event loop. With a rate, every request keeps its arrival time,
so the requests sent, their contents and their times are those of one process; a closed loop's
lanes are shared out among the processes. The processes start together (a barrier once every
target is ready), their records are merged, and the generator's load is the busiest process's."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any, TextIO

from loraserve.clients.bench.runner import GeneratorLoad, Progress, RunLimits, Runner, RunResult
from loraserve.clients.bench.targets import Target
from loraserve.clients.bench.workload import BenchRequest

START_TIMEOUT_S = 120.0  # for every process to start and connect its target


def share(limits: RunLimits, k: int, processes: int) -> RunLimits:
    """Process k's part of the run's limits: its requests of the count, its lanes (or in-flight
    cap); the same duration."""
    n = limits.num_requests
    count = None if n is None else len(range(k, n, processes))
    lanes = limits.concurrency
    if lanes is not None:
        lanes = lanes // processes + (1 if k < lanes % processes else 0)
    return replace(limits, num_requests=count, concurrency=lanes)


def check(limits: RunLimits, processes: int) -> None:
    if processes < 1:
        raise ValueError(f"need at least one generator process, got {processes}")
    if limits.concurrency is not None and limits.concurrency < processes:
        raise ValueError(f"{processes} generator processes need a concurrency of at least {processes}")
    if limits.num_requests is not None and limits.num_requests < processes:
        raise ValueError(f"{processes} generator processes need at least {processes} requests")


def every(
    stream: Iterable[BenchRequest], k: int, processes: int, num_requests: int | None
) -> Iterator[BenchRequest]:
    """The requests of process k: those of the first `num_requests` (all: None) with index k mod P."""
    head = iter(stream) if num_requests is None else itertools.islice(stream, num_requests)
    return (r for r in head if r.index % processes == k)


def merge(results: list[RunResult]) -> RunResult:
    records = sorted((r for res in results for r in res.records), key=lambda r: r.index)
    first = min((r.sent_s for r in records), default=0.0)
    last = max((r.end_s for r in records), default=0.0)
    lags: dict[str, float | None] = {}
    for res in results:  # each percentile as bad as the worst process's
        for key, value in res.generator.lag_ms.items():
            old = lags.get(key)
            lags[key] = value if old is None else (old if value is None else max(old, value))
    busy = max((res.generator.busy_share for res in results), default=0.0)
    return RunResult(records, last - first, GeneratorLoad(busy, lags))


def _child(
    k: int,
    processes: int,
    make_target: Callable[[], Target],
    stream: Iterable[BenchRequest],
    limits: RunLimits,
    barrier: Any,
    counters: Any,
    conn: Any,
    progress_interval_s: float | None,
) -> None:
    try:
        result = asyncio.run(
            _run_child(k, processes, make_target, stream, limits, barrier, counters, progress_interval_s)
        )
        conn.send(("ok", result))
    except BaseException as exc:  # reported to the parent, which raises it
        barrier.abort()
        conn.send(("error", exc if isinstance(exc, Exception) else RuntimeError(repr(exc))))
    finally:
        conn.close()


async def _run_child(
    k: int,
    processes: int,
    make_target: Callable[[], Target],
    stream: Iterable[BenchRequest],
    limits: RunLimits,
    barrier: Any,
    counters: Any,
    progress_interval_s: float | None,
) -> RunResult:
    target = make_target()
    await target.start()
    try:
        mine = share(limits, k, processes)

        def report(p: Progress) -> None:
            counters[4 * k : 4 * k + 4] = [p.sent, p.done, p.failed, p.tokens]

        runner = Runner(target, mine, progress_interval_s=progress_interval_s, progress_sink=report)
        await asyncio.to_thread(barrier.wait, START_TIMEOUT_S)  # every process's target is ready
        result = await runner.run(every(stream, k, processes, limits.num_requests))
        report(runner.progress)
        return result
    finally:
        await target.close()


async def run_processes(
    make_target: Callable[[], Target],
    stream: Iterable[BenchRequest],
    limits: RunLimits,
    processes: int,
    *,
    progress_interval_s: float | None = 2.0,
    progress_out: TextIO = sys.stderr,
) -> RunResult:
    """The run from `processes` processes; `make_target` and `stream` are sent to each (picklable:
    a module-level callable or a functools.partial of one, a RequestStream)."""
    check(limits, processes)
    ctx = mp.get_context("spawn")  # no fork of a process that holds gRPC's threads
    barrier = ctx.Barrier(processes)
    counters = ctx.Array("q", 4 * processes, lock=False)
    pipes = [ctx.Pipe(duplex=False) for _ in range(processes)]
    children = [
        ctx.Process(
            target=_child,
            args=(k, processes, make_target, stream, limits, barrier, counters, send, progress_interval_s),
            name=f"bench-generator-{k}",
            daemon=True,
        )
        for k, (_, send) in enumerate(pipes)
    ]
    for child in children:
        child.start()
    for _, send in pipes:
        send.close()  # the parent's copy: a child that dies leaves its pipe at its end
    t0 = time.perf_counter()

    async def report() -> None:
        assert progress_interval_s is not None
        while True:
            await asyncio.sleep(progress_interval_s)
            sent, done, failed, tokens = (sum(counters[i::4]) for i in range(4))
            line = Progress(sent, done, failed, tokens).line(time.perf_counter() - t0)
            print(f"{line}  ({processes} generator processes)", file=progress_out, flush=True)

    def receive(recv: Any) -> tuple[str, Any]:
        try:
            got: tuple[str, Any] = recv.recv()
            return got
        except EOFError:
            return "error", RuntimeError("a load generator process died")

    reporter = asyncio.create_task(report()) if progress_interval_s else None
    try:
        got = await asyncio.gather(*(asyncio.to_thread(receive, recv) for recv, _ in pipes))
    finally:
        if reporter is not None:
            reporter.cancel()
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
    errors = [value for kind, value in got if kind == "error"]
    # a process that failed broke the barrier: the others' BrokenBarrierError follows from it
    first = next(
        (e for e in errors if type(e).__name__ != "BrokenBarrierError"), errors[0] if errors else None
    )
    if first is not None:
        raise first
    return merge([value for _, value in got])
