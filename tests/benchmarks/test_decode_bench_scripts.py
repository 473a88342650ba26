"""The GPU-only decode benchmarks start as their users run them (`python benchmarks/NAME`, from any
directory): each imports what it needs (profile_decode.py takes helpers of two other scripts) and
answers --help; their measurements need a CUDA GPU."""

from __future__ import annotations

import pytest

from tests.helpers.benchmark_scripts import run_script


@pytest.mark.parametrize("name", ["profile_decode.py", "bench_decode_attention.py"])
def test_the_script_starts(name: str, tmp_path) -> None:
    out = run_script(name, "--help", timeout=120, cwd=tmp_path).stdout
    assert "usage:" in out and "--json" in out
