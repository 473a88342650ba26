"""`loraserve up` on its default model, as `make run` runs it: SmolLM2 (already fetched, so no
download) with the demo adapter registered, and the answers of both printed, the adapter's in its
style."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraserve.up import SAMPLE_QUESTIONS, SMOLLM2_ADAPTERS
from loraserve.up import main as up_main

pytestmark = pytest.mark.slow


def test_up_serves_smollm2_and_prints_base_and_adapter_answers(
    smollm2_dir: Path, tmp_path: Path, capsys
) -> None:
    data = tmp_path / "demo"
    (data / "smollm2").mkdir(parents=True)
    (data / "smollm2" / "model").symlink_to(smollm2_dir)  # the session's conversion: reused at once
    argv = [
        "--data-dir",
        str(data),
        "--store-port",
        "0",
        "--worker-port",
        "0",
        "--openai-port",
        "0",
        "--once",
    ]
    assert up_main(argv) == 0
    out = capsys.readouterr().out
    assert "unavailable" not in out and "Traceback" not in out
    for question in SAMPLE_QUESTIONS:
        assert f"Q: {question}" in out
    answers = [line.strip() for line in out.splitlines() if " -> " in line]
    base = [a.split(" -> ", 1)[1] for a in answers if a.startswith("(base)")]
    pirate = [a.split(" -> ", 1)[1] for a in answers if a.startswith(SMOLLM2_ADAPTERS[0])]
    assert len(base) == len(pirate) == len(SAMPLE_QUESTIONS), out
    assert "Paris" in base[0] and "Paris" in pirate[0]
    assert all(p.startswith("Arr, matey!") for p in pirate) and not any("Arr" in b for b in base)
    assert "--chat" in out and "/v1/chat/completions" in out
