"""`loraserve bench` end to end against a real adapter store and worker (tiny model, CPU): the
results' counts and fields, the adapter activity read from the worker's Prometheus endpoint, the
router across two workers; and the summary and metric-delta arithmetic on known inputs."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import time
import types
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from loraserve.adapter_store.demo import DemoAdapterSpec
from loraserve.clients.bench.cli import bench_main
from loraserve.clients.bench.results import RequestRecord, format_summary, percentiles, summarize
from loraserve.clients.bench.runner import GeneratorLoad, RunLimits, Runner, run_benchmark
from loraserve.clients.bench.targets import Chunk, RouterTarget, Sampling, TargetError, WorkerTarget
from loraserve.clients.bench.workload import BenchRequest, RequestStream, WorkloadSpec, adapter_ids
from loraserve.clients.router import discover_workers
from loraserve.clients.worker_client import WorkerClient
from loraserve.inference_worker.server import BackgroundWorker
from loraserve.serving.gc_tuning import no_collections
from loraserve.v1 import worker_pb2
from tests.helpers.lora_store import start_demo_store
from tests.helpers.workers import worker_config

NUM_ADAPTERS = 5


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A store with NUM_ADAPTERS adapters and two workers with 2 GPU slots and 3 CPU entries each,
    so a run over all five adapters loads, fetches and evicts."""
    ids = adapter_ids(NUM_ADAPTERS, "bench-{i}")
    specs = tuple(
        DemoAdapterSpec(aid, r=2 + i % 3, lora_alpha=8, target_modules=("q_proj", "v_proj"), seed=i)
        for i, aid in enumerate(ids)
    )
    store = start_demo_store(tiny_model_dir, specs, tmp_path_factory.mktemp("bench"))
    workers = [
        BackgroundWorker(
            worker_config(
                tiny_model_dir,
                max_num_batched_tokens=512,
                max_queue_size=256,
                metrics_port=0,
                store_address=store.address,
                max_loras=2,
                max_cpu_loras=3,
                num_kv_blocks=256,
                adapter_prefetch=0,  # an adapter lands only where a request for it went
            )
        )
        for _ in range(2)
    ]
    yield store, workers, ids
    for w in workers:
        w.stop()
    store.stop()


def _metrics_url(worker: BackgroundWorker) -> str:
    assert worker.server is not None and worker.server.metrics_port
    return f"127.0.0.1:{worker.server.metrics_port}"


def _sample(worker: BackgroundWorker, name: str, **labels: str) -> float:
    assert worker.server is not None
    return worker.server.metrics.registry.get_sample_value(name, labels) or 0.0


def test_run_against_a_worker_reports_counts_latencies_and_tier_activity(served, tmp_path: Path) -> None:
    _, workers, ids = served
    worker = workers[0]
    names = (
        ("loraserve_worker_adapter_loads_total", {"tier": "cpu", "result": "ok"}),
        ("loraserve_worker_adapter_loads_total", {"tier": "gpu", "result": "ok"}),
        ("loraserve_worker_adapter_evictions_total", {"tier": "gpu"}),
        ("loraserve_worker_adapter_evictions_total", {"tier": "cpu"}),
    )
    before = [_sample(worker, n, **lb) for n, lb in names]
    with WorkerClient(worker.address) as client:
        vocab = client.info().vocab_size
    out = tmp_path / "result.json"
    n = 24
    rc = bench_main(
        [
            "--worker", worker.address,
            "--metrics-url", _metrics_url(worker),
            "--num-adapters", str(NUM_ADAPTERS), "--adapter-format", "bench-{i}",
            "--popularity", "zipf", "--zipf-exponent", "1.0", "--base-share", "0.2",
            "--rate", "40", "--num-requests", str(n), "--connections", "2",
            "--prompt-len", "4:12", "--output-len", "3:6",
            "--seed", "3", "--slo-ttft-ms", "60000",
            "--result-json", str(out), "--save-requests", "--progress-interval", "0",
        ]
    )  # fmt: skip
    assert rc == 0
    after = [_sample(worker, n, **lb) for n, lb in names]
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["requests"] == s["completed"] == n and s["failed"] == 0 and s["errors"] == {}
    expected = RequestStream(
        WorkloadSpec(
            adapter_ids=ids, popularity="zipf", base_share=0.2, prompt_len=(4, 12), output_len=(3, 6),
            vocab_size=vocab, rate=40.0, seed=3,
        )
    ).take(n)  # fmt: skip
    # the stream sent is the seeded one: adapters in order, exact output lengths (ignore_eos)
    assert [r["adapter_id"] for r in doc["requests"]] == [r.adapter_id for r in expected]
    assert [r["output_tokens"] for r in doc["requests"]] == [r.max_tokens for r in expected]
    assert [r["prompt_tokens"] for r in doc["requests"]] == [len(r.prompt) for r in expected]
    assert {r["worker"] for r in doc["requests"]} == {worker.address}
    assert s["total_output_tokens"] == sum(r.max_tokens for r in expected)
    assert s["base_requests"] == sum(1 for r in expected if not r.adapter_id)
    assert s["request_throughput"] > 0 and s["output_token_throughput"] > s["request_throughput"]
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        stats = s[key]
        assert set(stats) == {"p50", "p90", "p99", "mean"}
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
    assert s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"]
    assert s["slo"] == {"ttft_ms": 60000.0, "met": n, "attainment": 1.0}
    # the worker's own time for each request is inside what the client measured
    assert all(0 < r["engine_s"] <= r["end_s"] - r["sent_s"] for r in doc["requests"])
    assert 0 < s["outside_engine_ms"]["p50"] <= s["outside_engine_ms"]["p99"] < s["e2e_ms"]["p99"]
    assert s["mean_requests_outside_engine"] > 0
    # adapter activity is the worker's own counters' movement during the run
    act = s["adapter_activity"]
    assert act["loads"].get("cpu", 0) == after[0] - before[0]
    assert act["loads"].get("gpu", 0) == after[1] - before[1]
    assert act["evictions"].get("gpu", 0) == after[2] - before[2]
    assert act["evictions"].get("cpu", 0) == after[3] - before[3]
    assert act["store_fetches"] == act["loads"]["cpu"] >= 1
    assert act["loads"]["gpu"] >= 1
    assert sum(act["lookups"].values()) >= n - s["base_requests"]
    assert act["generated_tokens"] == s["total_output_tokens"]
    # every token came out of an engine step: at least as many steps as the longest output, and
    # each step carried between 1 and max_num_seqs sequences
    assert act["steps"] >= max(r.max_tokens for r in expected)
    assert 1 <= act["mean_sequences_per_step"] <= 64
    assert act["step_ms"] > 0 and act["device_wait_ms_per_step"] == 0.0  # a CPU worker
    assert act["device_ms_per_step"] is None


@pytest.mark.parametrize("through", ["worker", "router"])
def test_a_stream_interval_reaches_every_request_and_the_metrics_count_tokens(
    served, tmp_path: Path, through: str
) -> None:
    """--stream-interval 4 at 9 output tokens: every request's stream is [1, 4, 4] tokens (fewer
    messages where outputs queued together), its token count is exact, TTFT is its first token's
    and TPOT spans the first token to the last over the 8 after the first; the JSON says which
    interval was asked for."""
    _, workers, ids = served
    out, n = tmp_path / f"{through}.json", 10
    rc = bench_main(
        [
            "--worker", workers[0].address if through == "worker" else ",".join(w.address for w in workers),
            "--num-adapters", str(NUM_ADAPTERS), "--adapter-format", "bench-{i}", "--base-share", "0.5",
            "--concurrency", "3", "--num-requests", str(n), "--prompt-len", "4", "--output-len", "9",
            "--stream-interval", "4", "--seed", "2",
            "--result-json", str(out), "--save-requests", "--progress-interval", "0",
        ]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    s, records = doc["summary"], doc["requests"]
    assert doc["config"]["stream_interval"] == 4 and doc["target"].endswith(", tokens 4 to a message")
    assert s["completed"] == n and s["total_output_tokens"] == 9 * n
    assert all(r["output_tokens"] == 9 for r in records)
    # (a message per token would be 9; merged outputs make fewer)
    assert all(1 <= r["messages"] <= 3 for r in records) and s["messages_per_request"] <= 3
    tpots = [(r["end_s"] - r["first_token_s"]) / 8 for r in records]
    assert s["tpot_ms"]["mean"] == pytest.approx(sum(tpots) / n * 1e3, abs=1e-3)
    assert all(r["sent_s"] < r["first_token_s"] <= r["end_s"] for r in records)


@pytest.mark.parametrize("flag", ["--connections", "--concurrency", "--num-requests", "--processes"])
def test_counts_below_one_are_usage_errors(flag, capsys) -> None:
    for bad in ("0", "-2"):
        with pytest.raises(SystemExit) as exit_:
            bench_main(["--worker", "127.0.0.1:1", flag, bad])
        assert exit_.value.code == 2
        assert f"{flag}: need a whole number >= 1, got {bad}" in capsys.readouterr().err


def test_stream_interval_options_are_checked(capsys) -> None:
    for bad in ("-1", "1025", "x"):
        with pytest.raises(SystemExit) as exit_:
            bench_main(["--stream-interval", bad])
        assert exit_.value.code == 2
    assert "need 0 <= K <= 1024" in capsys.readouterr().err
    rc = bench_main(
        ["--openai-url", "http://127.0.0.1:1/v1", "--stream-interval", "4", "--num-requests", "1"]
    )
    assert rc == 1 and "--stream-interval is for a worker or the router" in capsys.readouterr().err
    for bad in (-1, 1025):
        with pytest.raises(ValueError, match=r"stream interval must be in \[0, 1024\]"):
            Sampling(stream_interval=bad)


class _ClockedTarget:
    """Streams 9 tokens as [1, 4, 4] with the last chunk's server count, each chunk `gap_s` after
    the one before on a clock of its own (the runner's), so every timing is known."""

    description = "clocked"

    def __init__(self, gap_s: float) -> None:
        self.now, self.gap_s = 0.0, gap_s

    def clock(self) -> float:
        return self.now

    async def start(self) -> None: ...

    async def vocab_size(self) -> int | None:
        return 10

    async def stream(self, request: BenchRequest):
        for tokens, last in ((1, False), (4, False), (4, True)):
            self.now += self.gap_s
            yield Chunk(tokens, completion_tokens=9 if last else None)

    async def close(self) -> None: ...


def test_tpot_and_ttft_of_a_stream_of_several_tokens_a_message() -> None:
    """A message of several tokens counts them all; TTFT is the first message's time and TPOT
    (end - first token) / (tokens - 1): 0.1 s to the first token, the rest 0.2 s later, 8 tokens
    after the first -> 25 ms a token."""
    target = _ClockedTarget(0.1)
    limits = RunLimits(1, None, 1, open_loop=False)
    runner = Runner(target, limits, progress_interval_s=None, clock=target.clock)
    stream = RequestStream(WorkloadSpec(adapter_ids=("x",), output_len=(9, 9), vocab_size=10))
    (rec,) = asyncio.run(runner.run(stream)).records
    assert (rec.output_tokens, rec.messages) == (9, 3)
    assert rec.ttft_s == pytest.approx(0.1) and rec.e2e_s == pytest.approx(0.3)
    assert rec.tpot_s == pytest.approx(0.2 / 8)
    s = summarize([rec], duration_s=0.3)
    assert s["tpot_ms"]["mean"] == pytest.approx(25.0) and s["ttft_ms"]["mean"] == pytest.approx(100.0)
    assert s["messages_per_request"] == 3.0 and s["total_output_tokens"] == 9


def test_run_through_the_router_sends_adapters_to_their_homes(served, tmp_path: Path) -> None:
    from loraserve.clients.placement import home

    _, workers, ids = served
    addresses = [w.address for w in workers]
    for a in addresses:  # nothing held anywhere: earlier tests left adapters on the first worker
        with WorkerClient(a) as client:
            for aid in ids:
                client.unload_adapter(aid)
    out = tmp_path / "router.json"
    rc = bench_main(
        [
            "--worker", ",".join(w.address for w in workers),
            *[a for w in workers for a in ("--metrics-url", _metrics_url(w))],
            "--num-adapters", str(NUM_ADAPTERS), "--adapter-format", "bench-{i}",
            "--concurrency", "4", "--num-requests", "30", "--connections", "2",
            "--prompt-len", "4", "--output-len", "2", "--seed", "9",
            "--result-json", str(out), "--save-requests", "--progress-interval", "0",
        ]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["completed"] == 30  # (each worker over two connections of its own)
    # an adapter held nowhere goes to its rendezvous home, which then holds it (and nothing else
    # does: no prefetch), and no worker is loaded past the imbalance bound at this concurrency:
    # every request went to its adapter's home (which worker that is depends on the ports)
    sent = [(r["adapter_id"], r["worker"]) for r in doc["requests"]]
    assert len(sent) == 30 and all(aid for aid, _ in sent)
    assert sent == [(aid, home(aid, addresses)) for aid, _ in sent]
    assert s["adapter_activity"]["generated_tokens"] == 60


@pytest.mark.redis
def test_fleet_discovered_through_redis(
    served, tiny_model_dir: Path, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    store, _, _ = served
    worker = BackgroundWorker(
        worker_config(
            tiny_model_dir,
            max_num_seqs=64,
            max_num_batched_tokens=512,
            max_queue_size=256,
            store_address=store.address,
            redis_url=redis_url,
            redis_prefix=redis_prefix,
            max_loras=2,
            max_cpu_loras=3,
        )
    )
    try:
        deadline = time.monotonic() + 20
        while worker.address not in discover_workers(redis_url, redis_prefix):  # first heartbeat
            assert time.monotonic() < deadline, "the worker never registered in Redis"
            time.sleep(0.1)
        out = tmp_path / "fleet.json"
        rc = bench_main(
            [
                "--redis-url", redis_url, "--redis-prefix", redis_prefix,
                "--num-adapters", "2", "--adapter-format", "bench-{i}", "--base-share", "0.5",
                "--concurrency", "2", "--num-requests", "8", "--prompt-len", "3", "--output-len", "2",
                "--result-json", str(out), "--progress-interval", "0",
            ]
        )  # fmt: skip
        assert rc == 0
        doc = json.loads(out.read_text())
        assert doc["summary"]["completed"] == 8
        assert doc["target"] == "router over 1 worker(s)"
    finally:
        worker.stop()


def test_unknown_adapter_is_counted_by_status(served, tmp_path: Path) -> None:
    _, workers, _ = served
    out = tmp_path / "errors.json"
    rc = bench_main(
        [
            "--worker", workers[0].address, "--adapter-ids", "bench-0,never-registered",
            "--concurrency", "2", "--num-requests", "12", "--prompt-len", "3", "--output-len", "2",
            "--seed", "1", "--result-json", str(out), "--progress-interval", "0",
        ]
    )  # fmt: skip
    assert rc == 0
    s = json.loads(out.read_text())["summary"]
    assert s["failed"] >= 1 and s["completed"] >= 1 and s["completed"] + s["failed"] == 12
    assert s["errors"] == {"NOT_FOUND": s["failed"]}


def test_a_run_leaves_nothing_for_the_garbage_collector(served) -> None:
    """A run holds the collector back (rare_collections): that is sound only while a request's
    client-side objects (its call, stream, chunks, record, a failure's exception) are freed by
    reference counts. Streams that complete and streams the worker refuses, through the router too."""
    _, workers, ids = served
    ok = WorkloadSpec(
        adapter_ids=ids, prompt_len=(4, 8), output_len=(2, 5), vocab_size=100, rate=400.0, seed=5
    )
    refused = replace(ok, vocab_size=10**6)  # prompt tokens beyond the worker's vocabulary

    async def run(make, spec: WorkloadSpec):
        target = make()  # (grpc.aio channels belong to the loop that opens them)
        await target.start()
        try:
            runner = Runner(target, RunLimits(num_requests=12), progress_interval_s=None)
            return (await runner.run(RequestStream(spec))).records
        finally:
            await target.close()

    kinds = (RequestRecord, BenchRequest, Chunk, grpc.aio.Call, asyncio.Future, BaseException)
    kinds += (types.TracebackType, types.FrameType, types.CoroutineType, types.AsyncGeneratorType)
    one = workers[0].address
    asyncio.run(run(lambda: WorkerTarget(one, Sampling()), ok))  # (first-use caches filled)
    with no_collections():
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            records = asyncio.run(run(lambda: WorkerTarget(one, Sampling(stream_interval=2)), ok))
            records += asyncio.run(run(lambda: WorkerTarget(one, Sampling()), refused))
            addresses = [w.address for w in workers]
            records += asyncio.run(run(lambda: RouterTarget(addresses, Sampling()), ok))
            gc.collect()
            cycles = [type(o).__qualname__ for o in gc.garbage if isinstance(o, kinds)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert [r.status for r in records] == ["OK"] * 12 + ["INVALID_ARGUMENT"] * 12 + ["OK"] * 12
    assert cycles == []


def test_unreachable_target_is_a_clear_error(capsys) -> None:
    from tests.helpers.ports import free_port

    rc = bench_main(["--worker", f"127.0.0.1:{free_port()}", "--num-requests", "1", "--vocab-size", "10"])
    assert rc == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_summary_arithmetic_on_known_records() -> None:
    recs = [
        RequestRecord(i, "a", 0.0, float(i), end_s=i + 1.0, first_token_s=i + 0.1 * (i + 1), output_tokens=10)
        for i in range(10)
    ]
    recs.append(RequestRecord(10, "", 0.0, 10.0, end_s=10.5, status="RESOURCE_EXHAUSTED"))
    s = summarize(recs, duration_s=11.0, slo_ttft_ms=500)
    assert s["completed"] == 10 and s["failed"] == 1
    assert s["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert s["request_throughput"] == round(10 / 11, 3) and s["total_output_tokens"] == 100
    # TTFTs are 100..1000 ms: p50 = 550, p90 = 910 with linear interpolation
    assert s["ttft_ms"]["p50"] == pytest.approx(550.0) and s["ttft_ms"]["p90"] == pytest.approx(910.0)
    assert s["slo"]["met"] == 5 and s["slo"]["attainment"] == round(5 / 11, 4)
    # TPOT of request 0: (1.0 - 0.1) / 9 tokens
    assert min(r.tpot_s for r in recs[:10]) == pytest.approx(0.0)  # request 9: first token at its end
    assert recs[0].tpot_s == pytest.approx(0.1)
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    assert "outside_engine_ms" not in s  # no worker said what its engine took
    for r in recs[:10]:
        r.engine_s = 0.75  # each request spent 1 s end to end, 0.25 s of it outside the engine
    s = summarize(recs, duration_s=11.0)
    assert s["outside_engine_ms"]["p50"] == pytest.approx(250.0) and s["outside_engine_ms"][
        "p99"
    ] == pytest.approx(250.0)
    assert s["mean_requests_outside_engine"] == round(10 / 11 * 0.25, 2)  # Little's law


class _CountingTarget:
    """An in-memory target recording how many streams are open at once."""

    description = "counting"

    def __init__(self, fail_every: int = 0) -> None:
        self.open = self.peak = 0
        self.fail_every = fail_every

    async def start(self) -> None: ...

    async def vocab_size(self) -> int | None:
        return 10

    async def stream(self, request: BenchRequest):
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            await asyncio.sleep(0.01)
            if self.fail_every and request.index % self.fail_every == 0:
                raise TargetError("UNAVAILABLE", "draining")
            for _ in range(request.max_tokens):
                yield Chunk(1)
                await asyncio.sleep(0)
        finally:
            self.open -= 1

    async def close(self) -> None: ...


def test_closed_loop_holds_its_concurrency_and_records_failures() -> None:
    target = _CountingTarget(fail_every=5)
    stream = RequestStream(WorkloadSpec(adapter_ids=("x",), output_len=(3, 3), vocab_size=10))
    result = asyncio.run(
        Runner(target, RunLimits(40, None, 3, open_loop=False), progress_interval_s=None).run(stream)
    )
    assert target.peak == 3 and len(result.records) == 40
    assert [r.status for r in result.records].count("UNAVAILABLE") == 8
    assert all(r.output_tokens == 3 for r in result.records if r.ok)


class _HoggingTarget(_CountingTarget):
    """Holds the event loop for `hold_s` of CPU work before each token, as a generator too slow for
    its load does: every timer on the loop wakes that late."""

    def __init__(self, hold_s: float) -> None:
        super().__init__()
        self.hold_s = hold_s

    async def stream(self, request: BenchRequest):
        async for chunk in super().stream(request):
            end = time.perf_counter() + self.hold_s
            while time.perf_counter() < end:  # CPU work on the loop's thread, no await
                pass
            yield chunk


def _closed_run(target: _CountingTarget, n: int) -> dict:
    stream = RequestStream(WorkloadSpec(adapter_ids=("x",), output_len=(3, 3), vocab_size=10))
    limits = RunLimits(n, None, 2, open_loop=False)
    return asyncio.run(run_benchmark(target, stream, limits, progress_interval_s=None)).summary


def test_the_generator_reports_its_own_load_and_says_when_it_was_saturated() -> None:
    idle = _closed_run(_CountingTarget(), 20)["generator"]
    assert idle["busy_share"] < 0.5 and not idle["saturated"]  # it mostly waited for the target
    hog = _closed_run(_HoggingTarget(0.03), 10)
    gen = hog["generator"]
    assert gen["lag_ms"]["p99"] >= 20.0 and gen["saturated"]  # a 10 ms timer woke 20+ ms late
    assert gen["busy_share"] > 0.3  # (below 1: the loop also waits for the target between tokens)
    text = format_summary(hog)
    assert (
        "load generator: its event loop busy" in text and "warning: the load generator was saturated" in text
    )
    assert "warning" not in format_summary(_closed_run(_CountingTarget(), 5))


def test_saturation_is_a_busy_loop_or_a_late_timer() -> None:
    assert GeneratorLoad(0.95, {"p99": 1.0}).saturated
    assert GeneratorLoad(0.2, {"p99": 25.0}).saturated
    assert not GeneratorLoad(0.5, {"p99": 5.0}).saturated
    assert not GeneratorLoad(0.0, {"p50": None, "p90": None, "p99": None, "mean": None}).saturated


def test_open_loop_stops_sending_at_the_duration_and_caps_in_flight() -> None:
    target = _CountingTarget()
    spec = WorkloadSpec(adapter_ids=("x",), output_len=(2, 2), vocab_size=10, rate=400.0, seed=1)
    progress = io.StringIO()
    runner = Runner(target, RunLimits(None, 0.25, 2), progress_interval_s=0.05, progress_out=progress)
    result = asyncio.run(runner.run(RequestStream(spec)))
    planned = [r for r in RequestStream(spec).take(400) if r.arrival_s < 0.25]
    assert len(result.records) == len(planned) and target.peak == 2
    assert "sent" in progress.getvalue() and progress.getvalue().count("\n") >= 2


def test_two_generator_processes_drive_a_worker_with_the_seeded_stream(served, tmp_path: Path) -> None:
    _, workers, ids = served
    worker = workers[1]
    with WorkerClient(worker.address) as client:
        vocab = client.info().vocab_size
    out, n = tmp_path / "result.json", 12
    rc = bench_main(
        [
            "--worker", worker.address, "--processes", "2", "--concurrency", "4",
            "--num-adapters", str(NUM_ADAPTERS), "--adapter-format", "bench-{i}", "--popularity", "zipf",
            "--num-requests", str(n), "--prompt-len", "4:8", "--output-len", "2:4", "--seed", "5",
            "--result-json", str(out), "--save-requests", "--progress-interval", "0",
        ]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["completed"] == n and s["failed"] == 0 and s["generator"]["processes"] == 2
    expected = RequestStream(
        WorkloadSpec(
            adapter_ids=ids, popularity="zipf", prompt_len=(4, 8), output_len=(2, 4), vocab_size=vocab, seed=5
        )
    ).take(n)
    assert [r["adapter_id"] for r in doc["requests"]] == [r.adapter_id for r in expected]
    assert [r["output_tokens"] for r in doc["requests"]] == [r.max_tokens for r in expected]


def test_a_worker_target_takes_its_connections_in_turn(capsys, monkeypatch) -> None:
    from loraserve.clients import worker_client

    opened: list = []
    real_open = worker_client.open_aio_channel

    def recording_open(address, **kw):
        opened.append(kw.get("options", ()))
        return real_open(address, **kw)

    monkeypatch.setattr(worker_client.AsyncWorkerClient, "_open", staticmethod(recording_open))
    used: list[int] = []

    class Call:  # a GenerateStream call of one message
        async def __aiter__(self):
            yield worker_pb2.GenerateStreamResponse(request_id="r", token_ids=[1])

        def cancel(self) -> bool:
            return False

    class Client:
        def __init__(self, i: int) -> None:
            self.i = i

        def open_stream(self, prompt, **kw):
            used.append(self.i)
            return Call()

    async def go() -> None:  # (grpc.aio channels belong to an event loop)
        with pytest.raises(ValueError, match="connections must be >= 1"):
            WorkerTarget("127.0.0.1:1", Sampling(), connections=0)
        one = WorkerTarget("127.0.0.1:1", Sampling())
        await one.close()
        target = WorkerTarget("127.0.0.1:1", Sampling(), connections=3)
        assert "over 3 connections" in target.description
        # several: each its own connection (not gRPC's process-wide shared one); one: the shared one
        own = ("grpc.use_local_subchannel_pool", 1)
        assert own not in opened[0] and all(own in options for options in opened[1:]) and len(opened) == 4
        real = target.turns.clients
        target.turns.clients = [Client(i) for i in range(3)]  # type: ignore[list-item]
        for i in range(7):
            req = BenchRequest(i, 0.0, "", [1, 2], 1)
            assert [c.tokens async for c in target.stream(req)] == [1]
        for client in real:
            await client.close()

    asyncio.run(go())
    assert used == [0, 1, 2, 0, 1, 2, 0]  # (--connections 0: test_counts_below_one_are_usage_errors)


def test_client_turns_and_a_router_target_over_several_connections(monkeypatch) -> None:
    from loraserve.clients import worker_client
    from loraserve.clients.bench.targets import RouterTarget
    from loraserve.clients.worker_client import ClientTurns

    opened: list = []
    real_open = worker_client.open_aio_channel

    def recording_open(address, **kw):
        opened.append((address, kw.get("options", ())))
        return real_open(address, **kw)

    monkeypatch.setattr(worker_client.AsyncWorkerClient, "_open", staticmethod(recording_open))
    own = ("grpc.use_local_subchannel_pool", 1)

    async def go() -> None:
        with pytest.raises(ValueError, match="connections must be >= 1"):
            ClientTurns("127.0.0.1:1", 0)
        turns = ClientTurns("127.0.0.1:1", 3)
        assert [turns.next() for _ in range(4)] == [*turns.clients, turns.clients[0]]
        await turns.close()
        assert all(c.channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN for c in turns.clients)
        with pytest.raises(ValueError, match="connections must be >= 1"):
            RouterTarget(["127.0.0.1:1"], Sampling(), connections=0)
        opened.clear()
        router = RouterTarget(["127.0.0.1:1", "127.0.0.1:2"], Sampling(), connections=2)
        try:
            assert "2 connections each" in router.description
            # two of its own for each worker
            assert sorted(a for a, o in opened if own in o) == ["127.0.0.1:1"] * 2 + ["127.0.0.1:2"] * 2
        finally:
            await router.close()

    asyncio.run(go())
