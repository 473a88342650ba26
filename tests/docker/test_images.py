"""docker/Dockerfile.*: pinned bases, the worker on the torch and Triton the GPU runs were made with
(and that `make check-gpu-compile` compiles with), the store on CPU torch of the same release, and
default commands that our own CLIs accept."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from loraserve.adapter_store.config import StoreConfig
from loraserve.inference_worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
STORE = (ROOT / "docker" / "Dockerfile.store").read_text()
WORKER = (ROOT / "docker" / "Dockerfile.worker").read_text()


def _instructions(dockerfile: str, keyword: str) -> list[str]:
    joined = re.sub(r"\\\n", " ", dockerfile)
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.startswith(keyword + " ")]


def _arg(dockerfile: str, name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in _instructions(dockerfile, "ARG") if a.startswith(name + "=")]
    return value


def _exec_form(dockerfile: str, keyword: str) -> list[str]:
    (value,) = _instructions(dockerfile, keyword)
    return json.loads(value)


@pytest.mark.parametrize("dockerfile", [STORE, WORKER], ids=["store", "worker"])
def test_bases_are_pinned(dockerfile: str) -> None:
    for base in _instructions(dockerfile, "FROM"):
        image, _, tag = base.split()[0].partition(":")
        assert re.match(r"\d+\.\d+\.\d+", tag), f"base {base} is not pinned to a release"


def test_worker_runs_the_gpu_runs_torch_and_triton() -> None:
    torch, triton = _arg(WORKER, "TORCH_VERSION"), _arg(WORKER, "TRITON_VERSION")
    (base,) = _instructions(WORKER, "FROM")
    assert base.startswith(f"pytorch/pytorch:{torch}-cuda"), base
    makefile = (ROOT / "Makefile").read_text()
    (gpu_triton,) = re.findall(r"^GPU_TRITON \?= (\S+)$", makefile, re.M)
    assert triton == gpu_triton, "the worker image and `make check-gpu-compile` must use one Triton"
    assert '"triton==${TRITON_VERSION}"' in WORKER and "PIP_CONSTRAINT=/etc/pip-constraints.txt" in WORKER


def test_store_image_is_cpu_only_on_the_same_torch() -> None:
    (base,) = _instructions(STORE, "FROM")
    assert base.startswith("python:"), base
    assert "assert torch.version.cuda is None" in STORE, "the build must fail on a CUDA torch"
    assert _arg(STORE, "TORCH_VERSION") == _arg(WORKER, "TORCH_VERSION")
    (install,) = [r for r in _instructions(STORE, "RUN") if '"torch==${TORCH_VERSION}"' in r]
    assert "--index-url https://download.pytorch.org/whl/cpu" in install
    assert "PIP_CONSTRAINT=/etc/pip-constraints.txt" in STORE


def test_default_commands_parse() -> None:
    for dockerfile, command, config in ((STORE, "store", StoreConfig), (WORKER, "worker", WorkerConfig)):
        assert _exec_form(dockerfile, "ENTRYPOINT") == ["loraserve"]
        cmd = _exec_form(dockerfile, "CMD")
        assert cmd[0] == command
        cfg = config.from_args(cmd[1:], env={})
        assert cfg.host == "0.0.0.0"


def test_health_checks_ask_the_default_port() -> None:
    for dockerfile, config in ((STORE, StoreConfig), (WORKER, WorkerConfig)):
        port = config.from_args(_exec_form(dockerfile, "CMD")[1:], env={}).port
        (healthcheck,) = _instructions(dockerfile, "HEALTHCHECK")
        probe = json.loads(healthcheck.split(" CMD ", 1)[1])
        assert probe[:3] == ["loraserve", "health", f"127.0.0.1:{port}"]


def test_build_context_leaves_the_local_environment_out() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "deploy/kubernetes/tokens.env"} <= set(ignored)
