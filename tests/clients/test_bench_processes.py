"""`loraserve bench --processes`: one request stream driven from several processes. The same
requests are sent as from one (by index, each at its arrival time), every one is recorded once,
and a process that cannot start its target fails the run with its error."""

from __future__ import annotations

import asyncio
import functools
import io
import itertools
import time

import pytest

from loraserve.clients.bench.processes import every, merge, share
from loraserve.clients.bench.results import RequestRecord
from loraserve.clients.bench.runner import GeneratorLoad, RunLimits, RunResult, check_processes, run_benchmark
from loraserve.clients.bench.targets import TargetError
from loraserve.clients.bench.workload import RequestStream, WorkloadSpec
from tests.helpers.bench_targets import EchoTarget, FirstFails, UnreachableTarget


def test_each_process_takes_requests_in_proportion_to_its_lanes() -> None:
    # a closed loop of 5 lanes over 3 processes: lanes 0, 3 | 1, 4 | 2; request i rides lane i mod 5
    limits = RunLimits(10, None, 5, open_loop=False)
    parts = [share(limits, k, 3) for k in range(3)]
    assert [p.concurrency for p in parts] == [2, 2, 1] and [p.num_requests for p in parts] == [4, 4, 2]
    assert all(p.duration_s is None and not p.open_loop for p in parts)
    spec = WorkloadSpec(adapter_ids=("a", "b"), vocab_size=10, seed=2)
    got = [[r.index for r in every(RequestStream(spec), k, 3, limits)] for k in range(3)]
    assert got == [[0, 3, 5, 8], [1, 4, 6, 9], [2, 7]]
    # with arrival times: request i from process i mod P, each at its time
    timed = RunLimits(10, None, None)
    got = [[r.index for r in every(RequestStream(spec), k, 3, timed)] for k in range(3)]
    assert got == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert [share(timed, k, 3).num_requests for k in range(3)] == [4, 3, 3]
    with pytest.raises(ValueError, match="concurrency of at least 3"):
        check_processes(RunLimits(10, None, 2, open_loop=False), 3)
    with pytest.raises(ValueError, match="at least 4 requests"):
        check_processes(RunLimits(3, None, None), 4)


def test_merged_records_are_in_stream_order_and_the_generator_is_its_busiest_process() -> None:
    def result(indices: list[int], busy: float, p99: float | None) -> RunResult:
        records = [RequestRecord(i, "", i * 0.1, i * 0.1 + 0.01, end_s=i * 0.1 + 0.5) for i in indices]
        return RunResult(records, 0.0, GeneratorLoad(busy, {"p50": 1.0, "p99": p99}))

    got = merge([result([1, 3], 0.4, 2.0), result([0, 2, 4], 0.7, None)])
    assert [r.index for r in got.records] == [0, 1, 2, 3, 4]
    assert got.duration_s == pytest.approx(0.4 + 0.5 - 0.01)
    assert got.generator.busy_share == 0.7 and got.generator.lag_ms == {"p50": 1.0, "p99": 2.0}


def _run(limits: RunLimits, spec: WorkloadSpec, processes: int, fail_every: int = 0, **kw) -> dict:
    async def go():
        return await run_benchmark(
            EchoTarget(fail_every),
            RequestStream(spec),
            limits,
            processes=processes,
            make_target=functools.partial(EchoTarget, fail_every),
            **kw,
        )

    return asyncio.run(go())


def test_a_closed_loop_from_two_processes_sends_the_stream_once_each() -> None:
    spec = WorkloadSpec(
        adapter_ids=("x", "y", "z"), popularity="zipf", output_len=(2, 4), vocab_size=10, seed=4
    )
    progress = io.StringIO()
    got = _run(RunLimits(40, None, 4, open_loop=False), spec, 2, fail_every=5, progress_interval_s=0.05,
               progress_out=progress)  # fmt: skip
    records, summary = got.records, got.summary
    want = RequestStream(spec).take(40)
    assert [r.index for r in records] == list(range(40))
    assert [r.adapter_id for r in records] == [r.adapter_id for r in want]
    assert [r.output_tokens for r in records if r.ok] == [r.max_tokens for r in want if r.index % 5]
    assert summary["failed"] == 8 and summary["errors"] == {"UNAVAILABLE": 8}
    assert len({r.worker for r in records if r.ok}) == 2  # both processes served
    assert summary["generator"]["processes"] == 2
    assert "2 generator processes" in progress.getvalue()
    # 4 lanes in all, 2 a process (not 4 each): at most 4 requests in flight at once, give or take
    # one where the two processes' clocks (taken at the start barrier) differ by a hair
    events = sorted([(r.sent_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    in_flight = list(itertools.accumulate(step for _, step in events))
    assert max(in_flight) <= 5


def test_an_open_loop_from_three_processes_keeps_every_arrival_time() -> None:
    spec = WorkloadSpec(adapter_ids=("x",), output_len=(2, 2), vocab_size=10, rate=300.0, seed=1)
    got = _run(RunLimits(None, 0.4, None), spec, 3, progress_interval_s=None)
    planned = [r for r in RequestStream(spec).take(1000) if r.arrival_s < 0.4]
    assert [r.index for r in got.records] == [r.index for r in planned]
    assert [r.scheduled_s for r in got.records] == [r.arrival_s for r in planned]
    # sent when planned (the processes start together), give or take the machine's scheduling
    late = sorted(r.sent_s - r.scheduled_s for r in got.records)
    assert late[len(late) // 2] < 0.05


def test_a_process_that_cannot_reach_its_target_fails_the_run_with_that_error(tmp_path) -> None:
    def run(make_target, processes: int):
        return asyncio.run(
            run_benchmark(
                EchoTarget(),
                RequestStream(WorkloadSpec(adapter_ids=("x",), vocab_size=10)),
                RunLimits(8, None, 3, open_loop=False),
                processes=processes,
                make_target=make_target,
                progress_interval_s=None,
                on_start=lambda: pytest.fail("the run started"),
            )
        )

    with pytest.raises(TargetError, match="no such worker"):
        run(UnreachableTarget, 2)
    # one of three fails while the others wait for it at the start: its error, not theirs
    with pytest.raises(TargetError, match="no such worker"):
        run(functools.partial(FirstFails, str(tmp_path / "marker")), 3)
    with pytest.raises(ValueError, match="at least one"):
        run(EchoTarget, 0)


def test_the_run_starts_when_every_process_is_ready() -> None:
    started = []
    spec = WorkloadSpec(adapter_ids=("x",), output_len=(2, 2), vocab_size=10, seed=3)
    got = _run(RunLimits(6, None, 2, open_loop=False), spec, 2, progress_interval_s=None,
               on_start=lambda: started.append(time.perf_counter()))  # fmt: skip
    assert len(started) == 1 and got.summary["completed"] == 6


def test_the_command_line_refuses_a_process_count_its_load_cannot_share_before_connecting(capsys) -> None:
    from loraserve.clients.bench.cli import bench_main

    argv = ["--worker", "127.0.0.1:1", "--num-requests", "10"]
    assert bench_main([*argv, "--processes", "3", "--concurrency", "2"]) == 1
    err = capsys.readouterr().err
    assert "generator process" in err and "UNAVAILABLE" not in err
    with pytest.raises(SystemExit) as usage:  # no count at all: the command line's own error
        bench_main([*argv, "--processes", "0"])
    assert usage.value.code == 2 and "--processes: need a whole number >= 1" in capsys.readouterr().err
