"""The install layout: one `loraserve` namespace, imports that point one way, a thin client.

Arrows: services (adapter_store, inference_worker) may import the contract, the serving plumbing,
the kernels and the clients; the clients, the contract and the serving plumbing import no service;
the kernels import nothing else of ours; the HTTP gateway reaches the services through the clients
only. The thin install (no extras) carries no torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]

# folder -> the loraserve packages its modules may import (besides itself and loraserve.v1)
ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "loraserve/contract": set(),
    "loraserve/serving": set(),
    "clients": {"loraserve.contract"},
    "adapter_store": {"loraserve.contract", "loraserve.serving", "loraserve.clients"},
    "inference_worker": {"loraserve.contract", "loraserve.serving", "loraserve.clients", "loraserve.kernels"},
    # the HTTP gateway talks to the services only through the clients
    "gateway": {"loraserve.contract", "loraserve.serving", "loraserve.clients"},
}
SELF = {
    "kernels": "loraserve.kernels",
    "loraserve/contract": "loraserve.contract",
    "loraserve/serving": "loraserve.serving",
    "clients": "loraserve.clients",
    "adapter_store": "loraserve.adapter_store",
    "inference_worker": "loraserve.inference_worker",
    "gateway": "loraserve.gateway",
}


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def _package_of(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "loraserve" or len(parts) < 2:
        return None
    return ".".join(parts[:2])


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_point_one_way(folder: str) -> None:
    allowed = ALLOWED[folder] | {SELF[folder], "loraserve.v1"}
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in _imports(path):
            pkg = _package_of(name)
            if pkg is not None and pkg not in allowed and name != "loraserve.__version__":
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_no_import_outside_the_namespace() -> None:
    top = {"kernels", "clients", "adapter_store", "inference_worker", "gateway"}
    bad = []
    for folder in [*top, "loraserve", "tests", "benchmarks", "docker"]:
        for path in sorted((ROOT / folder).rglob("*.py")):
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in _imports(path) if n.split(".")[0] in top]
    assert not bad, "\n".join(bad)


def test_thin_install_declares_no_torch() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in project["dependencies"]}
    assert "torch" not in base and "triton" not in base
    server = " ".join(project["optional-dependencies"]["server"])
    assert "torch" in server
    assert any("triton" in d for d in project["optional-dependencies"]["gpu"])


def test_clients_and_cli_run_without_torch() -> None:
    """The clients, the stubs and the command line import with torch made unimportable."""
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
        "import loraserve.clients.store_client, loraserve.clients.worker_client, loraserve.clients.router\n"
        "import loraserve.clients.store_cli, loraserve.clients.worker_cli, loraserve.contract.chunk_codec\n"
        "from loraserve.cli import main\n"
        "assert main(['--version']) == 0\n"
        "assert main(['register', '--help']) == 0\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("loraserve ")
