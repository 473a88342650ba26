"""bench_serving --variant-tree: a worker run from another checkout imports `loraserve` from that
checkout, and so do the processes it starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.serving_fleet import PACKAGE_FOLDERS, tree_shim


def _fake_checkout(root: Path, mark: str) -> Path:
    (root / "loraserve").mkdir(parents=True)
    (root / "loraserve" / "__init__.py").write_text(f"MARK = {mark!r}\n")
    (root / "loraserve" / "cli.py").write_text("import sys\nprint('cli of', __import__('loraserve').MARK)\n")
    for folder in PACKAGE_FOLDERS:
        (root / folder).mkdir()
        (root / folder / "__init__.py").write_text(f"WHERE = {folder!r}\n")
    return root


def test_a_process_started_outside_the_checkout_imports_the_other_tree(tmp_path):
    tree = _fake_checkout(tmp_path / "other", "other tree")
    shim = tree_shim(tree, tmp_path / "work" / "code-x")
    env = {**os.environ, "PYTHONPATH": str(shim)}
    code = (
        "import subprocess, sys, loraserve, loraserve.kernels as k;"
        "print(loraserve.MARK, k.WHERE);"
        "subprocess.run([sys.executable, '-m', 'loraserve.cli'], check=True)"  # a child of its own
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path / "work",
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split("\n")[:2] == ["other tree kernels", "cli of other tree"]
    tree_shim(tree, tmp_path / "work" / "code-x")  # made again over the last one


def test_a_folder_that_is_no_checkout_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="not a checkout"):
        tree_shim(tmp_path, tmp_path / "shim")
