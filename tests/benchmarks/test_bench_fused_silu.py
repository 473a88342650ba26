"""benchmarks/bench_fused_silu.py runs as a script (its imports resolve from any directory); on a
machine without CUDA it says that it needs one and exits 2 instead of failing somewhere inside."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.benchmark_scripts import run_script


def test_help_lists_the_sweep_option(tmp_path) -> None:
    done = run_script("bench_fused_silu.py", "--help", timeout=120, cwd=tmp_path)
    assert "--tiles" in done.stdout and "--tokens" in done.stdout


def test_without_cuda_it_says_so() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the GPU run is the benchmark itself")
    done = run_script("bench_fused_silu.py", "--tokens", "64", timeout=120, returncode=2)
    assert "needs a CUDA GPU" in done.stderr
