"""When the serving benchmark's warm-up goes on (--settle): while the share of requests whose
adapter came from the store keeps falling and is above the floor; what a row's line says."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.bench_serving import Bench
from benchmarks.serving_report import line_for, still_warming, store_share


def test_store_share_is_what_was_not_resident() -> None:
    summary = {"ttft_ms_by_tier": {"gpu": {"count": 70}, "cpu": {"count": 20}, "store": {"count": 10}}}
    assert store_share(summary) == 0.1
    assert store_share({"ttft_ms_by_tier": {}}) is None  # no adapter requests


def test_warming_goes_on_while_the_store_share_falls_and_stops_at_a_floor_or_a_level() -> None:
    assert still_warming(None, 0.4)  # the first look: only the floor decides
    assert still_warming(0.4, 0.2)  # halved: the tiers are still filling
    assert not still_warming(0.2, 0.18)  # levelled off: tiers smaller than the adapter set
    assert not still_warming(0.05, 0.015)  # at the floor: every adapter is resident
    assert not still_warming(0.3, None)
    assert not still_warming(None, 0.01)


def _summary(store: float, seconds: float = 5.0) -> dict:
    n = 1000
    by_tier = {"gpu": {"count": round(n * (1 - store))}, "store": {"count": round(n * store)}}
    return {"ttft_ms_by_tier": by_tier, "duration_s": seconds, "request_throughput": 100.0}


def _settle(shares: list[float], settle: float, max_warmup: float) -> tuple[list[dict], list[dict]]:
    """Bench.settle over a load whose store share goes through `shares`, after a 5 s warm-up at
    0.5; (the periods it reports, the runs it asked for)."""
    asked: list[dict] = []

    def load(target, ids, **kw):
        asked.append(kw)
        return _summary(shares[len(asked) - 1])

    bench = SimpleNamespace(args=SimpleNamespace(settle=settle, max_warmup=max_warmup), load=load)
    return Bench.settle(bench, None, ["a"], 5, _summary(0.5), "metrics"), asked


def test_settling_runs_more_warm_up_while_the_store_share_falls_within_the_time_allowed() -> None:
    periods, asked = _settle([0.2, 0.1, 0.09, 0.01], settle=5, max_warmup=60)
    assert [p["store_share"] for p in periods] == [0.2, 0.1, 0.09]  # levelled off at 0.09
    assert all(kw["duration"] == 5 and kw["rate"] is None for kw in asked)
    assert len({kw["seed"] for kw in asked}) == 3  # each period a stream of its own
    periods, _ = _settle([0.2, 0.1, 0.05], settle=5, max_warmup=12)  # 5 s warm-up + 5 s, no room for more
    assert [p["store_share"] for p in periods] == [0.2]
    assert _settle([0.2], settle=0, max_warmup=60)[0] == []  # off


def test_a_row_line_names_the_collections_at_80_percent_load() -> None:
    lat = {"p50": 9.0, "p99": 40.0}
    row = {
        "saturation": {"request_throughput": 250.0, "output_token_throughput": 20000.0},
        "load_80": {
            "ttft_ms": lat,
            "ttft_ms_by_tier": {"gpu": {**lat, "count": 10}},
            "adapter_activity": {"gc_collections": {"0": 5, "1": 1}, "gc_over_10ms": 3},
        },
    }
    line = line_for(1000, row)
    assert "N= 1000  saturation 250.00 req/s 20000 tok/s" in line
    assert "gc at 80% {'0': 5, '1': 1} (3 over 10 ms)" in line
    row["load_80"]["adapter_activity"] = {"gc_collections": {}, "gc_over_10ms": 0}
    assert "gc at" not in line_for(1000, row)  # none: nothing said
    assert "sequences" not in line_for(1000, row)
    row["saturation"]["adapter_activity"] = {
        "step_ms": 2.5,
        "mean_sequences_per_step": 54.2,
        "step_admissions": {"max_num_seqs": 300, "queue_empty": 700},
    }
    assert "2.5 ms a step (54.2 sequences, admission ended by queue_empty 70%, max_num_seqs 30%)" in line_for(
        1000, row
    )
    row["saturation"] |= {
        "outside_engine_ms": {"p50": 30.0, "mean": 40.5},
        "mean_requests_outside_engine": 10.1,
    }
    assert "max_num_seqs 30%), outside the engine 40.5 ms a request (10.1 requests on average)" in line_for(
        1000, row
    )
    row["saturation"]["cpu"] = {
        "worker": 0.98,
        "worker_busiest_threads": [0.7, 0.25],
        "worker's front": [0.91],
        "benchmark's generator": [0.5, 0.48],
        "worker's child": [0.0],
    }
    want = "cpu at saturation: worker 0.98 (threads [0.7, 0.25]) worker's front [0.91]  benchmark's generator [0.5, 0.48]"
    assert want in line_for(1000, row) and "child" not in line_for(1000, row)  # idle: not named
