"""The fetch-contention benchmark end to end, briefly: one adapter fetched from a store process
by both paths, alone and beside busy threads, into a table and JSON."""

from __future__ import annotations

import json

import pytest

from loraserve.inference_worker.fetching.process import FetchProcess
from tests.helpers.benchmark_scripts import run_script


@pytest.mark.slow
@pytest.mark.skipif(not FetchProcess.supported(), reason="no /dev/shm")
def test_fetch_contention_benchmark_smoke(tmp_path):
    out = tmp_path / "fetch.json"
    done = run_script(
        "bench_fetch_contention.py", "--repeats", "2", "--rounds", "1", "--rank", "4", "--json", str(out),
        timeout=180,
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {f"{p}|{load}" for p in ("in-process", "fetch process") for load in ("alone", "busy")}
    assert all(r["n"] == 2 and 0 < r["median_ms"] <= r["p90_ms"] for r in rows.values()), rows
    assert "busy: in-process / fetch process" in done.stdout
