"""The serving benchmark end to end on CPU with tiny sizes: a store and workers as real processes
over gRPC, the N sweep (saturation, 50% / 80% load, TTFT by tier) and the two-worker prefetch runs
sharing a real Redis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.benchmark_scripts import run_script


@pytest.mark.slow
@pytest.mark.redis
def test_serving_benchmark_smoke(tmp_path, redis_url, redis_prefix):
    out = tmp_path / "serving.json"
    args = [
        "--workdir", str(tmp_path / "work"), "--shape", "tiny", "--device", "cpu", "--dtype", "float32",
        "--num-adapters", "12", "--ns", "2,12", "--max-loras", "2", "--max-cpu-loras", "6",
        "--store-cache", "3", "--max-num-seqs", "4", "--max-num-batched-tokens", "128",
        "--kv-cache-mb", "32", "--prompt-len", "8:16", "--output-len", "2:6", "--warmup", "0.5", "--first-warmup", "0.5",
        "--settle", "0.5", "--max-warmup", "2",
        "--duration", "1.5", "--prefetch", "6", "--prefetch-warmup", "1.5", "--prefetch-duration", "1.5",
        "--redis-url", redis_url, "--redis-prefix", redis_prefix, "--processes", "2", "--json", str(out),
        "--variant-tree", f"self={Path(__file__).resolve().parents[2]}",  # this checkout, run from outside it
    ]  # fmt: skip
    run_script("bench_serving.py", *args, timeout=280)
    got = json.loads(out.read_text())
    for n in ("2", "12"):
        row = got["n"][n]
        for phase in ("saturation", "load_50", "load_80"):
            assert row[phase]["completed"] > 0 and row[phase]["failed"] == 0, (n, phase, row[phase])
        assert row["load_50"]["offered_rate"] == pytest.approx(0.5 * row["saturation"]["request_throughput"])
        tiers = row["saturation"]["ttft_ms_by_tier"]
        assert set(tiers) <= {"gpu", "cpu", "store"} and sum(t["count"] for t in tiers.values()) > 0
        assert row["saturation"]["adapter_activity"]["loads"]  # read from the worker's metrics
        assert row["saturation"]["generator"]["processes"] == 2  # the sweep's default
        # each settle period its store share and throughput (when they run: test_serving_report.py)
        assert all(set(period) == {"store_share", "request_throughput"} for period in row["settle"])
    # more adapters than slots and CPU entries: some requests found theirs only at the store
    assert "store" in got["n"]["12"]["saturation"]["ttft_ms_by_tier"]
    assert got["throughput_ratio"]["ratio"] > 0
    # the worker of --variant-tree ran the same sweep; the results name the tree, not its folder
    assert got["config"]["variant_trees"] == ["self"] and "variant_tree" not in got["config"]
    for n in ("2", "12"):
        assert got["variants"]["self"]["n"][n]["saturation"]["completed"] > 0
    for variant in ("off", "on"):
        for phase in ("warm", "both", "replaced"):
            run = got["prefetch"][variant][phase]
            assert run["failed"] == 0 and 0.0 <= run["resident_share"] <= 1.0, (variant, phase)
        held = got["prefetch"][variant]["both"]["holdings"]
        for when in ("before", "after"):
            h = held[when]  # read from the two workers' ListAdapters
            assert len(h["by_worker"]) == 2 and 0 < h["distinct"] <= 12 and 0.0 < h["share"] <= 1.0
            for tiers in h["by_worker"].values():
                assert tiers["gpu"] <= 2 and tiers["gpu"] + tiers["cpu"] <= 6 + 2
            assert h["held_twice"] <= h["distinct"] and all(0 <= r < 12 for r in h["ranks_held_twice"])
