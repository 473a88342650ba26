"""benchmarks/profile_summary.py on a py-spy raw profile: each thread's share of the samples, and
one thread's functions by inclusive share (a function counted once per sample, recursion or not)."""

from __future__ import annotations

from tests.helpers.benchmark_scripts import run_script

RAW = """\
thread (11): MainThread;<module> (cli.py:5);run (base_events.py:10);_run_once (base_events.py:20) 30
thread (12): engine-step;_loop (engine.py:210);step (engine.py:256);execute (model_runner.py:90) 50
thread (12): engine-step;_loop (engine.py:210);step (engine.py:256);schedule (scheduler.py:40) 15
thread (12): engine-step;_loop (engine.py:210);f (x.py:1);f (x.py:1) 5
"""


def test_thread_shares_and_inclusive_functions(tmp_path) -> None:
    raw = tmp_path / "n5-saturation.gil.txt"
    raw.write_text(RAW)
    out = run_script("profile_summary.py", str(raw), "--thread", "engine", timeout=60).stdout
    lines = [line.strip() for line in out.splitlines()]
    assert "== n5-saturation.gil.txt: 100 samples" in lines
    assert "70.0 %  thread (12): engine-step" in lines
    assert "30.0 %  thread (11): MainThread" in lines
    assert "-- 'engine': 70 samples; functions by inclusive share" in lines
    assert "100.0 %  _loop (engine.py)" in lines
    assert "71.4 %  execute (model_runner.py)" in lines
    assert "21.4 %  schedule (scheduler.py)" in lines
    assert "7.1 %  f (x.py)" in lines  # recursion counts the sample once
