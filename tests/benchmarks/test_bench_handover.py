"""The hand-over benchmark runs and reports every row it can on this machine."""

from __future__ import annotations

import json

from tests.helpers.benchmark_scripts import run_script


def test_handover_benchmark_smoke(tmp_path):
    out = tmp_path / "handover.json"
    run_script("bench_handover.py", "--calls", "20", "--json", str(out), timeout=60)
    row = json.loads(out.read_text())
    assert (
        set(row["alone"]) == set(row["beside"]) >= {"numpy slice copy, 32 KB", "memoryview slice copy, 32 KB"}
    )
    assert all(us > 0 for us in row["beside"].values()), row
