"""Driving a target with a request stream and timing every request.

Open loop (a rate): each request is sent at its Poisson arrival time whatever is in flight
(`max_concurrency` optionally caps in-flight requests, later ones wait). Closed loop (no rate):
`concurrency` lanes each send their next request when the previous one ends. A run ends after
`num_requests` requests or when `duration_s` has passed (nothing new is sent after it; what is in
flight finishes and counts)."""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TextIO

from loraserve.clients.bench import worker_metrics
from loraserve.clients.bench.collector import rare_collections
from loraserve.clients.bench.results import RequestRecord, latency_ms, summarize
from loraserve.clients.bench.targets import Target, TargetError
from loraserve.clients.bench.workload import BenchRequest


@dataclass(frozen=True)
class RunLimits:
    num_requests: int | None = None
    duration_s: float | None = None
    concurrency: int | None = None  # closed-loop lanes; with Poisson arrivals, the in-flight cap
    open_loop: bool = True  # Poisson arrival times; False: a closed loop of `concurrency` lanes

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("a run needs a request count or a duration")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"request count must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 seconds, got {self.duration_s}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not self.open_loop and self.concurrency is None:
            raise ValueError("a closed loop needs a concurrency")


@dataclass
class Progress:
    sent: int = 0
    done: int = 0
    failed: int = 0
    tokens: int = 0

    def line(self, elapsed: float) -> str:
        rate = self.done / elapsed if elapsed > 0 else 0.0
        return (
            f"[{elapsed:7.1f}s] sent {self.sent}  done {self.done}  failed {self.failed}  "
            f"in flight {self.sent - self.done - self.failed}  {rate:.2f} req/s  "
            f"{self.tokens / elapsed if elapsed > 0 else 0.0:.1f} tok/s"
        )


# The generator watches itself: how busy its event loop's thread was and how late a timer set on
# the loop woke. A generator that is busy (near a whole core) or late drives and times requests
# late, so what it measures is partly its own limit.
LAG_PROBE_S = 0.01  # the timer's period
BUSY_SHARE = 0.9  # a loop busy this share of the run is saturated
LATE_P99_MS = 20.0  # a timer this late (p99) delays sends and the reading of streams


@dataclass(frozen=True)
class GeneratorLoad:
    """The load generator's own load during a run: its event loop's thread's CPU time over the
    run's wall time, and how late a `LAG_PROBE_S` timer on the loop woke (ms)."""

    busy_share: float
    lag_ms: dict[str, float | None]

    @property
    def saturated(self) -> bool:
        late = self.lag_ms.get("p99")
        return self.busy_share >= BUSY_SHARE or (late is not None and late >= LATE_P99_MS)

    def as_dict(self) -> dict[str, object]:
        return {"busy_share": self.busy_share, "lag_ms": self.lag_ms, "saturated": self.saturated}


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float  # first send to last completion
    generator: GeneratorLoad

    @classmethod
    def of(cls, records: Iterable[RequestRecord], generator: GeneratorLoad) -> RunResult:
        """The records in stream order, timed from the first send to the last completion."""
        ordered = sorted(records, key=lambda r: r.index)
        first = min((r.sent_s for r in ordered), default=0.0)
        last = max((r.end_s for r in ordered), default=0.0)
        return cls(ordered, last - first, generator)


def check_processes(limits: RunLimits, processes: int) -> None:
    """A run's limits can be shared out among `processes` generator processes (processes.py)."""
    if processes < 1:
        raise ValueError(f"need at least one generator process, got {processes}")
    if limits.concurrency is not None and limits.concurrency < processes:
        raise ValueError(f"{processes} generator processes need a concurrency of at least {processes}")
    if limits.num_requests is not None and limits.num_requests < processes:
        raise ValueError(f"{processes} generator processes need at least {processes} requests")


class Runner:
    def __init__(
        self,
        target: Target,
        limits: RunLimits,
        *,
        progress_interval_s: float | None = 2.0,
        progress_out: TextIO = sys.stderr,
        clock: Callable[[], float] = time.perf_counter,
        progress_sink: Callable[[Progress], None] | None = None,
    ) -> None:
        """`progress_sink`: called with the progress every interval instead of printing it (a
        generator process reports to the one that prints, processes.py)."""
        self.target, self.limits = target, limits
        self.progress_interval_s, self.progress_out = progress_interval_s, progress_out
        self.progress_sink = progress_sink
        self.clock = clock
        self.progress = Progress()
        self.records: list[RequestRecord] = []
        self._t0 = 0.0

    def _now(self) -> float:
        return self.clock() - self._t0

    async def _one(self, req: BenchRequest, scheduled_s: float) -> None:
        rec = RequestRecord(req.index, req.adapter_id, scheduled_s, self._now(), prompt_tokens=req.prompt_len)
        self.records.append(rec)
        self.progress.sent += 1
        reported: int | None = None
        try:
            async for chunk in self.target.stream(req):
                rec.messages += 1
                if chunk.tokens:
                    if rec.first_token_s is None:
                        rec.first_token_s = self._now()
                    rec.output_tokens += chunk.tokens
                    self.progress.tokens += chunk.tokens
                if chunk.completion_tokens is not None:
                    reported = chunk.completion_tokens
                if chunk.prompt_tokens is not None:
                    rec.prompt_tokens = chunk.prompt_tokens
                rec.worker = chunk.worker or rec.worker
                rec.adapter_tier = chunk.adapter_tier or rec.adapter_tier
                if chunk.engine_ms is not None:
                    rec.engine_s = chunk.engine_ms / 1e3
        except TargetError as exc:
            rec.status, rec.error = exc.status, exc.message
        except Exception as exc:  # a run reports every failure, it never dies of one
            rec.status, rec.error = type(exc).__name__, str(exc)
        rec.end_s = self._now()
        if reported is not None:
            rec.output_tokens = reported  # the server's count is the truth (OpenAI chunks may hold several)
        if rec.ok:
            self.progress.done += 1
        else:
            self.progress.failed += 1

    def _requests(self, stream: Iterable[BenchRequest]) -> Iterator[BenchRequest]:
        n = self.limits.num_requests
        return iter(stream) if n is None else itertools.islice(stream, n)

    def _expired(self) -> bool:
        d = self.limits.duration_s
        return d is not None and self._now() >= d

    async def _open_loop(self, stream: Iterable[BenchRequest]) -> None:
        cap = self.limits.concurrency
        slots = asyncio.Semaphore(cap) if cap else None
        tasks: set[asyncio.Task[None]] = set()

        async def send(req: BenchRequest) -> None:
            try:
                await self._one(req, req.arrival_s)
            finally:
                if slots is not None:
                    slots.release()

        d = self.limits.duration_s
        for req in self._requests(stream):
            if d is not None and req.arrival_s >= d:
                break
            delay = req.arrival_s - self._now()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots is not None:
                await slots.acquire()
            task = asyncio.create_task(send(req))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    async def _closed_loop(self, stream: Iterable[BenchRequest]) -> None:
        requests = self._requests(stream)

        async def lane() -> None:
            while not self._expired():
                req = next(requests, None)
                if req is None:
                    return
                await self._one(req, self._now())

        assert self.limits.concurrency is not None
        await asyncio.gather(*(lane() for _ in range(self.limits.concurrency)))

    async def _report(self) -> None:
        assert self.progress_interval_s is not None
        while True:
            await asyncio.sleep(self.progress_interval_s)
            if self.progress_sink is not None:
                self.progress_sink(self.progress)
            else:
                print(self.progress.line(self._now()), file=self.progress_out, flush=True)

    async def _probe_lag(self, lags: list[float]) -> None:
        """How late a timer on the loop wakes (seconds), every LAG_PROBE_S."""
        while True:
            due = time.perf_counter() + LAG_PROBE_S
            await asyncio.sleep(LAG_PROBE_S)
            lags.append(max(0.0, time.perf_counter() - due))

    async def run(self, stream: Iterable[BenchRequest]) -> RunResult:
        """Drive the stream to its end; the process's garbage collector runs rarely meanwhile
        (`rare_collections`: its pauses would delay sends and the reading of streams)."""
        with rare_collections():
            return await self._run(stream)

    async def _run(self, stream: Iterable[BenchRequest]) -> RunResult:
        self._t0 = self.clock()
        wall0, cpu0 = time.perf_counter(), time.thread_time()  # this thread runs the loop
        lags: list[float] = []
        tasks = [asyncio.create_task(self._probe_lag(lags))]
        if self.progress_interval_s:
            tasks.append(asyncio.create_task(self._report()))
        try:
            if self.limits.open_loop:
                await self._open_loop(stream)
            else:
                await self._closed_loop(stream)
        finally:
            for task in tasks:
                task.cancel()
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        generator = GeneratorLoad(round(min(1.0, cpu / wall), 3) if wall > 0 else 0.0, latency_ms(lags))
        if self.progress_interval_s and self.progress_sink is None:
            print(self.progress.line(self._now()), file=self.progress_out, flush=True)
        return RunResult.of(self.records, generator)


@dataclass
class BenchmarkResult:
    summary: dict[str, object]
    records: list[RequestRecord]


async def run_benchmark(
    target: Target | None,
    stream: Iterable[BenchRequest],
    limits: RunLimits,
    *,
    metrics_urls: Sequence[str] = (),
    slo_ttft_ms: float | None = None,
    progress_interval_s: float | None = 2.0,
    progress_out: TextIO = sys.stderr,
    processes: int = 1,
    make_target: Callable[[], Target] | None = None,
    on_start: Callable[[], None] | None = None,
) -> BenchmarkResult:
    """Run the stream against a started target, reading the workers' metrics before and after.
    With `processes` > 1 the stream is driven from that many processes (processes.py), each with a
    target of its own from `make_target` (picklable); `target` is then not used (None will do).
    `on_start`: called as the first request may go out."""
    check_processes(limits, processes)
    if processes > 1 and make_target is None:
        raise ValueError("several generator processes need a target factory")
    if processes == 1 and target is None:
        raise ValueError("a run from this process needs a started target")
    before = await asyncio.to_thread(worker_metrics.scrape_all, metrics_urls) if metrics_urls else None
    if processes > 1:
        from loraserve.clients.bench.processes import run_processes

        assert make_target is not None
        result = await run_processes(
            make_target,
            stream,
            limits,
            processes,
            progress_interval_s=progress_interval_s,
            progress_out=progress_out,
            on_start=on_start,
        )
    else:
        assert target is not None
        if on_start is not None:
            on_start()
        result = await Runner(
            target, limits, progress_interval_s=progress_interval_s, progress_out=progress_out
        ).run(stream)
    activity = None
    if before is not None:
        after = await asyncio.to_thread(worker_metrics.scrape_all, metrics_urls)
        activity = worker_metrics.activity(before, after)
    summary = summarize(
        result.records,
        duration_s=result.duration_s,
        slo_ttft_ms=slo_ttft_ms,
        activity=activity,
        generator={**result.generator.as_dict(), "processes": processes},
    )
    return BenchmarkResult(summary, result.records)
