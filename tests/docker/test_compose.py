"""docker/compose.yaml: the topology it declares, that every service command is accepted by our own
CLIs, and (only where a Docker engine answers) that compose itself accepts the file."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from adapter_store.config import StoreConfig
from inference_worker.config import WorkerConfig

COMPOSE = Path(__file__).resolve().parents[2] / "docker" / "compose.yaml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    return {k: str(v) for k, v in env.items()}


def test_topology(compose: dict) -> None:
    services = compose["services"]
    assert {"redis", "minio", "store", "worker-1", "worker-2"} <= set(services)
    for name in ("worker-1", "worker-2"):
        w = services[name]
        assert w["depends_on"]["store"]["condition"] == "service_healthy"
        assert w["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
        assert _env(w)["LORASERVE_REDIS_URL"].startswith("redis://redis:")
    assert _env(services["store"])["LORASERVE_REDIS_URL"].startswith("redis://redis:")
    assert _env(services["store"])["LORASERVE_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert services["worker-1"]["command"] != services["worker-2"]["command"]
    # the registry lives in Redis: it must survive a Redis restart
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes" and services["redis"]["volumes"]


def test_store_command_parses(compose: dict) -> None:
    store = compose["services"]["store"]
    cfg = StoreConfig.from_args(store["command"], env=_env(store))
    assert cfg.redis_url == "redis://redis:6379/0"
    assert cfg.s3_endpoint_url == "http://minio:9000"
    assert cfg.host == "0.0.0.0" and cfg.port == 50051


@pytest.mark.parametrize("name", ["worker-1", "worker-2"])
def test_worker_command_parses(compose: dict, name: str) -> None:
    worker = compose["services"][name]
    cfg = WorkerConfig.from_args(worker["command"], env=_env(worker))
    assert cfg.store_address == "store:50051"
    assert cfg.worker_id == name
    assert cfg.redis_url == "redis://redis:6379/0"


def _docker_engine() -> bool:
    if shutil.which("docker") is None:
        return False
    for cmd in (["docker", "info"], ["docker", "compose", "version"]):
        try:
            if subprocess.run(cmd, capture_output=True, timeout=20).returncode != 0:
                return False
        except (OSError, subprocess.TimeoutExpired):
            return False
    return True


@pytest.mark.docker
@pytest.mark.skipif(not _docker_engine(), reason="no Docker engine (docker info / docker compose version)")
def test_compose_config_is_valid() -> None:
    res = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
