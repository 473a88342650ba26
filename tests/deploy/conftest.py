"""The kustomize base, copied with a tokens.env made from tokens.env.example (as an operator does),
and the objects it renders to."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import pytest

from tests.helpers.kustomize import read_env_file, render

BASE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("kustomize") / "kubernetes"
    shutil.copytree(BASE, directory, ignore=shutil.ignore_patterns("tokens.env"))
    example = read_env_file(directory / "tokens.env.example")
    (directory / "tokens.env").write_text("".join(f"{key}={secrets.token_hex(16)}\n" for key in example))
    return directory


@pytest.fixture(scope="session")
def rendered(base_dir: Path) -> list[dict]:
    return render(base_dir)
