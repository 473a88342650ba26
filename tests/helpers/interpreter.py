"""Test code run through Triton's interpreter (TRITON_INTERPRET=1) in a Python process of its own:
Triton reads the setting once, so it must not leak into the rest of the test session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def interpreted(code: str, timeout: float = 240) -> str:
    """Runs `code` with the interpreter on; -> what it printed (the run must succeed)."""
    r = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def interpreted_value(code: str, expression: str, timeout: float = 240) -> Any:
    """Runs `code` with the interpreter on, then evaluates `expression` there; -> its value (JSON)."""
    out = interpreted(code + f"\nimport json\nprint(json.dumps({expression}))\n", timeout)
    return json.loads(out.strip().splitlines()[-1])
