"""One request stream driven from several processes, so the generator is not what limits a fast
target: one Python event loop reads a few tens of thousands of streamed messages a second.

Each process has its own target (its own connections) and its own event loop. With a rate,
process k of P sends the requests whose index is k modulo P, each at its arrival time, so the
requests sent, their contents and their times are those of one process; a closed loop's lanes are
shared out among the processes and its requests follow the lanes (`owner`). The processes start together (a barrier once every
target is ready), their records are merged, and the generator's load is the busiest process's."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, TextIO

from loraserve.clients.bench.runner import (
    GeneratorLoad,
    Progress,
    RunLimits,
    Runner,
    RunResult,
)
from loraserve.clients.bench.targets import Target
from loraserve.clients.bench.workload import BenchRequest

START_TIMEOUT_S = 120.0  # for every process to start and connect its target


def owner(index: int, processes: int, lanes: int | None) -> int:
    """The process that sends request `index`. A closed loop's requests follow its lanes (lane
    index mod C, held by process lane mod P), so each process gets requests in proportion to its
    lanes; with arrival times, index mod P."""
    return (index % lanes) % processes if lanes else index % processes


def share(limits: RunLimits, k: int, processes: int) -> RunLimits:
    """Process k's part of the run's limits: its requests of the count, its lanes (or its part of
    the in-flight cap); the same duration."""
    lanes = limits.concurrency
    closed = None if limits.open_loop else lanes
    n = limits.num_requests
    count = None if n is None else sum(1 for i in range(n) if owner(i, processes, closed) == k)
    if lanes is not None:
        lanes = lanes // processes + (1 if k < lanes % processes else 0)
    return replace(limits, num_requests=count, concurrency=lanes)


def every(
    stream: Iterable[BenchRequest], k: int, processes: int, limits: RunLimits
) -> Iterator[BenchRequest]:
    """The requests of process k among the run's (its first `num_requests`, or all)."""
    n = limits.num_requests
    head = iter(stream) if n is None else itertools.islice(stream, n)
    closed = None if limits.open_loop else limits.concurrency
    return (r for r in head if owner(r.index, processes, closed) == k)


def merge(results: list[RunResult]) -> RunResult:
    lags: dict[str, float | None] = {}
    for res in results:  # each percentile as bad as the worst process's
        for key, value in res.generator.lag_ms.items():
            old = lags.get(key)
            lags[key] = value if old is None else (old if value is None else max(old, value))
    busy = max((res.generator.busy_share for res in results), default=0.0)
    return RunResult.of((r for res in results for r in res.records), GeneratorLoad(busy, lags))


@dataclass(frozen=True)
class _Job:
    """What process k of P is sent (spawn pickles it)."""

    k: int
    processes: int
    make_target: Callable[[], Target]
    stream: Iterable[BenchRequest]
    limits: RunLimits
    barrier: Any  # P + 1 parties: the processes once their targets are ready, and the parent
    counters: Any  # sent, done, failed, tokens of each process
    progress_interval_s: float | None


def _sendable(exc: BaseException) -> Exception:
    """`exc` if it survives pickling (the parent raises it), else a RuntimeError that names it."""
    if isinstance(exc, Exception):
        try:
            pickle.loads(pickle.dumps(exc))
            return exc
        except Exception:
            pass
    return RuntimeError(f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc))}")


def _child(job: _Job, conn: Any) -> None:
    try:
        conn.send(("ok", asyncio.run(_run_child(job))))
    except BaseException as exc:  # reported to the parent, which raises it
        job.barrier.abort()
        with contextlib.suppress(Exception):
            conn.send(("error", _sendable(exc)))
    finally:
        conn.close()


async def _run_child(job: _Job) -> RunResult:
    target = job.make_target()
    await target.start()
    try:
        k = job.k

        def report(p: Progress) -> None:
            job.counters[4 * k : 4 * k + 4] = [p.sent, p.done, p.failed, p.tokens]

        mine = share(job.limits, k, job.processes)
        runner = Runner(target, mine, progress_interval_s=job.progress_interval_s, progress_sink=report)
        await asyncio.to_thread(job.barrier.wait, START_TIMEOUT_S)  # every target is ready
        result = await runner.run(every(job.stream, k, job.processes, job.limits))
        report(runner.progress)
        return result
    finally:
        await target.close()


def _collect(children: list[Any], pipes: list[Any], deadline: float | None) -> list[tuple[str, Any]]:
    """Each process's ("ok", RunResult) or ("error", exception), waiting on their pipes and their
    ends. Once one has failed, or at `deadline` (time.monotonic; before the run started), the
    others get a few seconds and are then stopped."""
    got: dict[int, tuple[str, Any]] = {}
    give_up: float | None = None
    while len(got) < len(children):
        waiting = {k: (pipes[k], children[k].sentinel) for k in range(len(children)) if k not in got}
        ends = [x for pair in waiting.values() for x in pair]
        limit = min((t for t in (give_up, deadline) if t is not None), default=None)
        ready = mp_connection.wait(ends, None if limit is None else max(0.0, limit - time.monotonic()))
        for k, (recv, sentinel) in waiting.items():
            if recv in ready or sentinel in ready:
                try:
                    got[k] = (
                        recv.recv()
                        if recv.poll()
                        else ("error", RuntimeError("a load generator process died"))
                    )
                except Exception as exc:  # a reply that cannot be read
                    got[k] = (
                        "error",
                        RuntimeError(f"a load generator process's reply was unreadable: {exc}"),
                    )
                if got[k][0] == "error" and give_up is None:
                    give_up = time.monotonic() + 5.0
        if not ready and limit is not None and time.monotonic() >= limit:
            for k in waiting:
                children[k].kill()
                got.setdefault(k, ("error", RuntimeError("a load generator process did not finish")))
    return [got[k] for k in range(len(children))]


async def run_processes(
    make_target: Callable[[], Target],
    stream: Iterable[BenchRequest],
    limits: RunLimits,
    processes: int,
    *,
    progress_interval_s: float | None = 2.0,
    progress_out: TextIO = sys.stderr,
    on_start: Callable[[], None] | None = None,
) -> RunResult:
    """The run from `processes` processes; `make_target` and `stream` are sent to each (picklable:
    a module-level callable or a functools.partial of one, a RequestStream). `on_start` is called
    when every process's target is ready and the run begins (the processes' start-up, a second or
    two, is not part of it); run_benchmark has checked the count."""
    ctx = mp.get_context("spawn")  # no fork of a process that holds gRPC's threads
    barrier = ctx.Barrier(processes + 1)
    counters = ctx.Array("q", 4 * processes, lock=False)
    pipes = [ctx.Pipe(duplex=False) for _ in range(processes)]
    children = [
        ctx.Process(
            target=_child,
            args=(
                _Job(k, processes, make_target, stream, limits, barrier, counters, progress_interval_s),
                send,
            ),
            name=f"bench-generator-{k}",
            daemon=True,
        )
        for k, (_, send) in enumerate(pipes)
    ]
    for child in children:
        child.start()
    for _, send in pipes:
        send.close()  # the parent's copy: a child that dies leaves its pipe at its end
    receivers = [recv for recv, _ in pipes]
    try:
        started = await asyncio.to_thread(_barrier_wait, barrier)
        if started and on_start is not None:
            on_start()
        t0 = time.perf_counter()

        async def report() -> None:
            assert progress_interval_s is not None
            while True:
                await asyncio.sleep(progress_interval_s)
                print_progress()

        def print_progress() -> None:
            sent, done, failed, tokens = (sum(counters[i::4]) for i in range(4))
            line = Progress(sent, done, failed, tokens).line(time.perf_counter() - t0)
            print(f"{line}  ({processes} generator processes)", file=progress_out, flush=True)

        reporter = asyncio.create_task(report()) if progress_interval_s and started else None
        # a run that did not start ends now (its processes report why); one that did runs its course
        deadline = None if started else time.monotonic() + 10.0
        try:
            got = await asyncio.to_thread(_collect, children, receivers, deadline)
        finally:
            if reporter is not None:
                reporter.cancel()
        if reporter is not None:
            print_progress()
    finally:
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
    errors = [value for kind, value in got if kind == "error"]
    # a process that failed broke the barrier: the others' BrokenBarrierError follows from it
    first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), None)
    if first is None and errors:
        first = errors[0]
    if first is not None:
        raise first
    return merge([value for _, value in got])


def _barrier_wait(barrier: Any) -> bool:
    """The parent's turn at the start barrier; False when a process broke it (or it timed out)."""
    try:
        barrier.wait(START_TIMEOUT_S)
        return True
    except threading.BrokenBarrierError:
        return False
