"""The tensor-parallel benchmark's CPU smoke mode (tiny shape, gloo, TP 1 and 2), so the script
cannot rot while no multi-GPU machine runs it."""

from __future__ import annotations

import json

import pytest

from tests.helpers.benchmark_scripts import run_script
from tests.inference_worker.parallel.conftest import needs_gloo


def test_help_runs_from_anywhere(tmp_path):
    done = run_script("bench_tp.py", "--help", timeout=60, cwd=tmp_path)
    assert "--shape" in done.stdout and "--device" in done.stdout


@needs_gloo
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cpu_smoke_mode(tmp_path):
    out = tmp_path / "tp.json"
    args = ["--device", "cpu", "--shape", "tiny", "--batches", "1,2"]
    args += ["--adapters", "0,2", "--tokens", "2", "--reps", "1", "--json", str(out)]
    done = run_script("bench_tp.py", *args, timeout=110, cwd=tmp_path)
    results = {r["tp"]: r for r in json.loads(out.read_text())}
    assert set(results) == {1, 2}
    for tp, r in results.items():
        rows = r["shapes"][0]["rows"]
        assert [(row["batch"], row["adapters"]) for row in rows] == [(1, 0), (1, 1), (2, 0), (2, 2)]
        assert all(row["tok_s"] > 0 for row in rows)
        with_lora = [row["lora_collectives_ms"] for row in rows if row["adapters"]]
        assert all((ms > 0) == (tp > 1) for ms in with_lora)
    assert "| tiny | 2 | 2 |" in done.stdout
