"""The fetch-concurrency benchmark end to end, briefly: distinct adapters fetched one and two at
once from a store process through the fetch process, into a table and JSON."""

from __future__ import annotations

import json

import pytest

from loraserve.inference_worker.fetching.process import FetchProcess
from tests.helpers.benchmark_scripts import run_script


@pytest.mark.slow
@pytest.mark.skipif(not FetchProcess.supported(), reason="no /dev/shm")
def test_fetch_concurrency_benchmark_smoke(tmp_path):
    out = tmp_path / "fetch.json"
    done = run_script(
        "bench_fetch_concurrency.py", "--ks", "1,2", "--rounds", "1", "--rank", "4", "--json", str(out),
        timeout=180,
    )  # fmt: skip
    data = json.loads(out.read_text())
    assert [r["k"] for r in data["rows"]] == [1, 2]
    for r in data["rows"]:
        assert 0 < r["fetch_median_ms"] <= r["fetch_p90_ms"] and r["fetches_per_s"] > 0, r
        assert r["store_cpu_ms_per_fetch"] > 0 and r["fetch_process_cpu_ms_per_fetch"] > 0, r
    assert "| fetches at once |" in done.stdout
