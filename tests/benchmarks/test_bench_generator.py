"""The generator benchmark end to end, briefly: a token server in its own process, one offered
rate, and the transport floor (the same stream read by a bare gRPC loop) beside it."""

from __future__ import annotations

import json

import pytest

from tests.helpers.benchmark_scripts import run_script


@pytest.mark.slow
def test_generator_benchmark_smoke(tmp_path):
    out = tmp_path / "generator.json"
    run_script(
        "bench_generator.py", "--rates", "20", "--duration", "1", "--output-len", "4", "--tpot-ms", "1",
        "--num-adapters", "10", "--floor", "--json", str(out), timeout=120,
    )  # fmt: skip
    got = json.loads(out.read_text())
    (row,) = got["rows"]
    assert row["sustained"] and row["failed"] == 0 and row["completed"] > 0, row
    floor = got["transport_floor"]
    assert floor["offered_rate"] == 20.0 and floor["requests"] > 0, floor
    assert 0 < floor["cpu_share"] <= 1.5 and 0 < floor["generator_cpu_share"] <= 1.5, floor
