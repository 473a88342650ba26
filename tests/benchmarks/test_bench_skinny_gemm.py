"""benchmarks/bench_skinny_gemm.py runs as a script (its imports resolve from any directory); its
sweep is listed without a GPU; on a machine without CUDA a timing run says that it needs one and
exits 2 instead of failing somewhere inside."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.benchmark_scripts import run_script


def test_help_lists_the_options(tmp_path) -> None:
    done = run_script("bench_skinny_gemm.py", "--help", timeout=120, cwd=tmp_path)
    for option in ("--quick", "--full", "--no-pdl", "--json", "--m M", "--list"):
        assert option in done.stdout, option


def test_list_prints_each_case_sweep(tmp_path) -> None:
    done = run_script(
        "bench_skinny_gemm.py",
        "--list",
        "--models",
        "1b",
        "--proj",
        "o,down",
        "--m",
        "1,16",
        "--sms",
        "132",
        timeout=120,
        cwd=tmp_path,
    )
    lines = done.stdout.splitlines()
    heads = [i for i, line in enumerate(lines) if "configs, default" in line]
    assert len(heads) == 4, done.stdout
    assert "1b o N=2048 K=2048 M=1:" in lines[heads[0]] and lines[heads[0]].endswith(".sum")
    assert lines[heads[-1]].endswith(".dot")  # 16 rows: tl.dot only
    for i in heads:  # each case's sweep: as many configurations as its header counts, at least one
        count = int(lines[i].split(": ")[1].split(" configs")[0])
        assert count > 0 and len(lines[i + 1].split()) == count, (lines[i], lines[i + 1])


def test_bad_arguments_are_refused(tmp_path) -> None:
    done = run_script("bench_skinny_gemm.py", "--list", "--m", "17", timeout=120, cwd=tmp_path, returncode=2)
    assert "rows outside" in done.stderr


def test_without_cuda_it_says_so(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the GPU run is the benchmark itself")
    done = run_script("bench_skinny_gemm.py", "--quick", "--m", "1", timeout=120, cwd=tmp_path, returncode=2)
    assert "needs a CUDA GPU" in done.stderr
