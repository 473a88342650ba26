"""Running a benchmark script the way its users do: `python benchmarks/NAME ...` in a process of
its own, from any directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_script(
    name: str, *args: str, timeout: float, cwd: Path | None = None, returncode: int = 0
) -> subprocess.CompletedProcess[str]:
    """benchmarks/`name` with this interpreter; fails the test, with the tail of its output, unless
    it exits with `returncode`."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
    assert done.returncode == returncode, done.stdout[-3000:] + done.stderr[-3000:]
    return done
