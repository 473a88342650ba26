"""The generator benchmark end to end, briefly: a token server in its own process, one offered
rate, and the transport floor (the same stream read by a bare gRPC loop) beside it."""

from __future__ import annotations

import json

import pytest

from tests.helpers.benchmark_scripts import run_script


@pytest.mark.slow
@pytest.mark.parametrize("interval, messages", [(0, 4), (2, 3), (8, 2)])
def test_generator_benchmark_smoke(tmp_path, interval: int, messages: int):
    """At 4 output tokens: a message a token, or with --stream-interval K the first token alone
    and then K a message, the rest with the last ([1, 2, 1] at K = 2, [1, 3] at K = 8), as the
    worker sends them; the generator counts what it read."""
    out = tmp_path / "generator.json"
    run_script(
        "bench_generator.py", "--rates", "20", "--duration", "1", "--output-len", "4", "--tpot-ms", "1",
        "--num-adapters", "10", "--stream-interval", str(interval), "--floor", "--json", str(out),
        timeout=120,
    )  # fmt: skip
    got = json.loads(out.read_text())
    assert got["stream_interval"] == interval and got["messages_per_request"] == messages and got["cpu"]
    (row,) = got["rows"]
    assert row["sustained"] and row["failed"] == 0 and row["completed"] > 0, row
    assert row["messages_per_request"] == messages
    assert row["messages_per_s"] == pytest.approx(row["achieved_rate"] * messages, rel=0.02)
    assert 0 < row["server_cpu_share"] <= 1.5, row
    floor = got["transport_floor"]
    assert floor["offered_rate"] == 20.0 and floor["requests"] > 0, floor
    assert 0 < floor["cpu_share"] <= 1.5 and 0 < floor["generator_cpu_share"] <= 1.5, floor
