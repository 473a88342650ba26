"""The Triton kernels under TRITON_INTERPRET=1 (float32 and float16: the interpreter's bf16 dot is
wrong), in a child process so the variable is set before the kernels are defined and stays there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.lora_cases import CASES

DTYPES = ("float32", "float16")

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, list[str]]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.interpreter_run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_triton_interpreter_matches_float64(interpreter_results, case, dtype_name) -> None:
    assert interpreter_results[f"{case.name}-{dtype_name}"] == []


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_preloading_expand_matches_float64(interpreter_results, case) -> None:
    assert interpreter_results[f"{case.name}-float16-preload"] == []


def test_triton_prepare_matches_torch_prepare(interpreter_results) -> None:
    assert interpreter_results["prepare"] == []


def test_too_many_slices_raise_before_any_launch(interpreter_results) -> None:
    assert interpreter_results["slice-limit"] == []
