"""The GPU-only decode benchmarks start as their users run them (`python benchmarks/NAME`, from any
directory): each imports what it needs (profile_decode.py takes helpers of two other scripts, the
norm and argmax benchmarks bench_skinny_gemm.py's) and answers --help; their measurements need a
CUDA GPU, and without one they say so and exit 2."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.benchmark_scripts import run_script


@pytest.mark.parametrize("name", ["profile_decode.py", "bench_decode_attention.py", "bench_skinny_norm.py"])
def test_the_script_starts(name: str, tmp_path) -> None:
    out = run_script(name, "--help", timeout=120, cwd=tmp_path).stdout
    assert "usage:" in out and "--json" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures on a GPU")
@pytest.mark.parametrize(
    "name", ["profile_decode.py", "bench_decode_attention.py", "bench_skinny_norm.py", "bench_row_argmax.py"]
)
def test_without_a_gpu_the_script_says_so(name: str, tmp_path) -> None:
    done = run_script(name, timeout=120, cwd=tmp_path, returncode=2)
    assert "needs a CUDA GPU" in done.stderr
