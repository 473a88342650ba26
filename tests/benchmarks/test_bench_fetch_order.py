"""The fetch-order benchmark end to end, briefly: a request's fetch behind prefetches, with the
worker's fetch order and in arrival order, from a store process through the fetch process."""

from __future__ import annotations

import json

import pytest

from loraserve.inference_worker.fetching.process import FetchProcess
from tests.helpers.benchmark_scripts import run_script


@pytest.mark.slow
@pytest.mark.skipif(not FetchProcess.supported(), reason="no /dev/shm")
def test_fetch_order_benchmark_smoke(tmp_path):
    out = tmp_path / "order.json"
    done = run_script(
        "bench_fetch_order.py", "--behind", "3", "--rounds", "1", "--rank", "4", "--json", str(out),
        timeout=180,
    )  # fmt: skip
    data = json.loads(out.read_text())
    assert data["behind"] == 3 and set(data["ms"]) == {"ordered", "arrival"}
    assert all(len(v) == 1 and v[0] > 0 for v in data["ms"].values()), data
    assert "| fetch order |" in done.stdout
