"""The fetch breakdown benchmark end to end, briefly: a store process, the worker's fetch paths and
the parts alone, into a table and JSON."""

from __future__ import annotations

import json

import pytest

from loraserve.inference_worker.fetching.process import FetchProcess
from tests.helpers.benchmark_scripts import run_script


@pytest.mark.slow
@pytest.mark.skipif(not FetchProcess.supported(), reason="no /dev/shm")
def test_fetch_breakdown_benchmark_smoke(tmp_path):
    out = tmp_path / "breakdown.json"
    done = run_script(
        "bench_fetch_breakdown.py", "--repeats", "1", "--rank", "4", "--json", str(out), timeout=180
    )
    data = json.loads(out.read_text())
    rows = data["ms"]
    for origin in ("memory", "disk"):
        for path in ("fetch process", "in-process", "fetch process, hand-over", "in-process, hand-over"):
            assert len(rows[f"worker fetch, {path} ({origin})"]) == 1
        (last,), (checked,) = (
            rows[f"receiving side, to the last chunk ({origin})"],
            rows[f"receiving side, to the digest checked ({origin})"],
        )
        assert 0 < last <= checked, origin
        assert rows[f"  CPU of the fetch process (fetch process, {origin})"][0] > 0
    for path in ("fetch process, hand-over", "in-process, hand-over"):
        assert len(rows[f"worker fetch, {path} (file there)"]) == 1
    assert rows["sha256, one thread"][0] > 0 and rows["worker: copy out of shared memory (in the fetch)"]
    assert "| worker fetch, fetch process (disk) |" in done.stdout
