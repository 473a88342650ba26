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


def test_the_worker_of_another_tree_gets_absolute_paths_from_a_relative_workdir(tmp_path, monkeypatch):
    """It starts in its own working directory: a relative path would point elsewhere, and Python
    would then import this checkout without a word."""
    from benchmarks import serving_fleet

    tree = _fake_checkout(tmp_path / "other", "other tree")
    monkeypatch.chdir(tmp_path)
    seen: dict = {}

    def spawn(name, args, log, env=None, cwd=None):
        seen.update(args=list(args), env=env, cwd=cwd)
        return subprocess.Popen([sys.executable, "-c", "pass"])

    monkeypatch.setattr(serving_fleet, "_spawn", spawn)
    (tmp_path / "work").mkdir()
    fleet = serving_fleet.Fleet(Path("work"))
    opts = serving_fleet.WorkerOptions(code_tree=str(tree))
    fleet.start_worker("w", Path("model"), "127.0.0.1:1", opts, wait=False)
    fleet.close()
    shim = Path(seen["env"]["PYTHONPATH"].split(os.pathsep)[0])
    assert shim.is_absolute() and (shim / "loraserve" / "kernels").resolve() == tree / "kernels"
    assert Path(seen["cwd"]).is_absolute()
    assert Path(seen["args"][seen["args"].index("--model") + 1]).is_absolute()
