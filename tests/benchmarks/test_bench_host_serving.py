"""The host-serving benchmark end to end, briefly: a worker process on fixed logits streams to the
load generator, and the CPU it spent per token is read back, split by thread."""

from __future__ import annotations

import json

import pytest

from tests.helpers.benchmark_scripts import run_script


@pytest.mark.slow
def test_host_serving_benchmark_smoke(tmp_path):
    out = tmp_path / "host.json"
    run_script(
        "bench_host_serving.py", "--concurrency", "8", "--output-len", "8", "--duration", "1.5",
        "--warmup", "0.5", "--max-num-seqs", "8", "--worker-arg=--stream-interval=2", "--json", str(out),
        timeout=120,
    )  # fmt: skip
    row = json.loads(out.read_text())
    assert row["failed"] == 0 and row["tokens_per_s"] > 0, row
    assert row["worker_args"] == "--stream-interval=2"
    assert row["worker_us_per_token"] > 0 and row["step_thread_us_per_token"] > 0, row
    total = row["step_thread_us_per_token"] + row["rest_us_per_token"]
    assert total == pytest.approx(row["worker_us_per_token"], abs=0.2), row
    # read from the worker's metrics: how full its steps were and what ended their admission (the
    # scrape worked), and collections by generation (none, with nothing left in cycles)
    assert 1 <= row["mean_sequences_per_step"] <= 8 and sum(row["step_admissions"].values()) > 0, row
    assert row["gc_collections"] == {} and row["gc_ms"] == {} and row["gc_over_10ms"] == 0, row


@pytest.mark.slow
def test_host_serving_benchmark_with_adapters(tmp_path):
    """With a store and more adapters than the worker's tiers hold, some of them unknown to the
    store: it fetches, copies into slots and evicts throughout, requests for the unknown ones fail
    NOT_FOUND, and none of it leaves the worker anything to collect."""
    out = tmp_path / "host.json"
    run_script(
        "bench_host_serving.py", "--concurrency", "8", "--output-len", "8", "--duration", "3",
        "--warmup", "1", "--max-num-seqs", "8", "--adapters", "12", "--max-loras", "2",
        "--max-cpu-loras", "4", "--unknown-every", "4", "--adapter-dir", str(tmp_path / "adapters"),
        "--json", str(out), timeout=240,
    )  # fmt: skip
    row = json.loads(out.read_text())
    assert row["adapters"] == 12 and row["max_loras"] == 2 and row["unknown_every"] == 4
    assert row["loads"]["cpu"] > 0 and row["evictions"]["cpu"] > 0 and row["evictions"]["gpu"] > 0, row
    assert row["failed"] == row["errors"]["NOT_FOUND"] > 0, row
    assert row["gc_collections"] == {} and row["gc_cpu_ms"] == {}, row
