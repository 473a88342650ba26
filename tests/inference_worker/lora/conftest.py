"""Fixtures of the LoRA slot tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def config(tiny_model_dir: Path) -> dict:
    """The tiny model's config.json."""
    return json.loads((tiny_model_dir / "config.json").read_text())
