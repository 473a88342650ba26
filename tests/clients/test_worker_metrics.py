"""What the bench reads from the workers' (and a store's) Prometheus metrics: the change between two
scrapes, summed over the workers, split by tier, origin and collector generation."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from loraserve.clients.bench import worker_metrics
from loraserve.inference_worker.adapters.metrics import AdapterMetrics
from loraserve.inference_worker.metrics import WorkerMetrics


def _scrape(*metrics) -> list[dict]:
    return [worker_metrics.parse(generate_latest(m.registry).decode()) for m in metrics]


def test_metric_delta_sums_workers_and_splits_failed_loads() -> None:
    a, b = AdapterMetrics(), AdapterMetrics()
    a.loads.labels("cpu", "ok").inc(2)
    before = _scrape(a, b)
    a.loads.labels("cpu", "ok").inc(3)
    a.loads.labels("gpu", "ok").inc(4)
    b.loads.labels("gpu", "ok").inc(1)
    b.loads.labels("cpu", "NOT_FOUND").inc(2)
    b.evictions.labels("gpu").inc(5)
    a.lookups.labels("miss").inc(3)
    b.lookups.labels("gpu").inc(7)
    a.load_seconds.labels("cpu").observe(0.030)
    b.load_seconds.labels("cpu").observe(0.050)
    b.load_seconds.labels("gpu").observe(0.002)
    after = _scrape(a, b)
    act = worker_metrics.activity(before, after)
    assert act.load_ms == {"cpu": 40.0, "gpu": 2.0}  # mean over both workers, by tier
    assert act.store_origins == {}
    assert act.loads == {"cpu": 3, "gpu": 5}
    assert act.failed_loads == {"cpu": 2}
    assert act.evictions == {"gpu": 5}
    assert act.store_fetches == 3
    assert act.lookups == {"gpu": 7, "miss": 3}
    assert worker_metrics.metrics_url("h:9090") == "http://h:9090/metrics"
    with pytest.raises(ValueError, match="http"):
        worker_metrics.scrape("file:///etc/passwd")


def test_a_stores_metrics_add_where_its_fetches_came_from() -> None:
    from loraserve.adapter_store.metrics import StoreMetrics

    worker, store = AdapterMetrics(), StoreMetrics()
    store.fetch_open_seconds.labels("memory").observe(0.001)
    before = _scrape(worker, store)
    for origin in ("memory", "disk", "disk", "source"):
        store.fetch_open_seconds.labels(origin).observe(0.01)
    worker.loads.labels("cpu", "ok").inc(4)
    after = _scrape(worker, store)
    act = worker_metrics.activity(before, after)
    assert act.store_origins == {"disk": 2, "memory": 1, "source": 1}
    assert act.store_fetches == 4 and act.as_dict()["store_fetch_origins"] == act.store_origins


def _engine() -> SimpleNamespace:
    """What WorkerMetrics reads from an engine, idle."""
    return SimpleNamespace(
        num_waiting=0,
        num_running=0,
        num_free_blocks=0,
        step_observer=None,
        timing=SimpleNamespace(observer=None),
    )


def test_garbage_collections_by_generation_and_the_long_ones() -> None:
    engine = _engine()
    a, b = WorkerMetrics(engine), WorkerMetrics(engine)  # type: ignore[arg-type]
    gc.disable()  # (no collection of its own while it counts them)
    try:
        before = _scrape(a, b)
        a.gc_pause.labels("0").observe(0.0004)
        a.gc_pause.labels("0").observe(0.008)
        a.gc_pause.labels("2").observe(0.030)
        b.gc_pause.labels("2").observe(0.120)
        b.gc_pause.labels("1").observe(0.004)
        b.gc_pause.labels("1").observe(0.015)
        a.gc_cpu.labels("0").observe(0.006)
        b.gc_cpu.labels("2").observe(0.080)
        act = worker_metrics.activity(before, _scrape(a, b))
        assert act.gc_collections == {"0": 2, "1": 2, "2": 2}
        assert act.gc_ms == {"0": 8.4, "1": 19.0, "2": 150.0}
        assert act.gc_cpu_ms == {"0": 6.0, "1": 0.0, "2": 80.0} == act.as_dict()["gc_cpu_ms"]
        assert act.gc_long == 3 and act.as_dict()["gc_over_10ms"] == 3  # (over 10 ms: 15, 30, 120)
        # the process's own collections are recorded, into every worker's registry, until closed
        before = _scrape(a, b)
        gc.collect(2)
        after = _scrape(a, b)
        assert all(
            worker_metrics.activity([x], [y]).gc_collections == {"2": 1}
            for x, y in zip(before, after, strict=True)
        )
        assert all(
            0 < worker_metrics.activity([x], [y]).gc_cpu_ms["2"] for x, y in zip(before, after, strict=True)
        )
        a.close()
        b.close()
        before = _scrape(a)
        gc.collect(2)
        assert worker_metrics.activity(before, _scrape(a)).gc_collections == {}
    finally:
        gc.enable()
        a.close()
        b.close()


def test_steps_by_what_ended_their_admission() -> None:
    engine = _engine()
    m = WorkerMetrics(engine)  # type: ignore[arg-type]
    try:
        observe = engine.step_observer
        observe("decode", 0.002, 64, 64, "max_num_seqs", 9)
        before = _scrape(m)
        for admission, adapters in (
            ("max_num_seqs", 7),
            ("queue_empty", 3),
            ("queue_empty", 0),
            ("adapter_wait", 2),
        ):
            observe("prefill", 0.003, 60, 300, admission, adapters)
        act = worker_metrics.activity(before, _scrape(m))
        assert act.step_admissions == {"adapter_wait": 1, "max_num_seqs": 1, "queue_empty": 2}
        assert act.steps == 4 and act.as_dict()["step_admissions"] == act.step_admissions
        assert act.as_dict()["mean_adapters_per_step"] == 3.0  # (7 + 3 + 0 + 2) / 4
    finally:
        m.close()
