"""docker/compose.yaml: valid against the Compose specification's JSON schema (the copy check-jsonschema
vendors), the topology it declares, and every command, flag and variable it gives our services is one
they accept; where a Docker engine answers, compose itself reads the file too."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from loraserve.adapter_store.config import StoreConfig
from loraserve.inference_worker.config import WorkerConfig
from loraserve.v1 import store_pb2, worker_pb2
from tests.helpers.cli_env import UnknownCommand, cli_flags, env_problems, flags_used
from tests.helpers.private_redis import PrivateRedis
from tests.helpers.redis_options import DURABLE, redis_server_options

COMPOSE = Path(__file__).resolve().parents[2] / "docker" / "compose.yaml"
STORE_SERVICE = store_pb2.DESCRIPTOR.services_by_name["AdapterStore"].full_name
WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["InferenceWorker"].full_name
WORKERS = ("worker-1", "worker-2")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _interpolate(value: str) -> str:
    """Compose's `${NAME:-default}` / `${NAME}` with nothing set in the environment."""
    return re.sub(r"\$\{[A-Z0-9_]+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)


def _env(service: dict) -> dict[str, str]:
    return {k: _interpolate(str(v)) for k, v in (service.get("environment") or {}).items()}


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(f"--{name}") + 1]


def _schema_check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_matches_the_compose_specification() -> None:
    res = _schema_check(COMPOSE)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_schema_check_rejects_a_broken_file(compose: dict, tmp_path: Path) -> None:
    compose = copy.deepcopy(compose)
    compose["services"]["worker-1"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] = "0"
    compose["services"]["store"]["healthchek"] = compose["services"]["store"].pop("healthcheck")
    broken = tmp_path / "compose.yaml"
    broken.write_text(yaml.safe_dump(compose))
    res = _schema_check(broken)
    assert res.returncode == 1
    assert "device_ids" in res.stdout and "healthchek" in res.stdout


def test_topology(compose: dict) -> None:
    services = compose["services"]
    assert {"redis", "s3", "seed", "store", "register", "gateway", *WORKERS} == set(services)
    for name in WORKERS:
        assert services[name]["depends_on"]["store"]["condition"] == "service_healthy"
        assert _env(services[name])["LORASERVE_REDIS_URL"].startswith("redis://redis:")
    store_env = _env(services["store"])
    assert store_env["LORASERVE_REDIS_URL"].startswith("redis://redis:")
    assert store_env["LORASERVE_S3_ENDPOINT_URL"] == "http://s3:5000"
    assert services["store"]["depends_on"]["seed"]["condition"] == "service_completed_successfully"
    gateway = services["gateway"]["command"]
    assert gateway[0] == "openai" and _flag(gateway, "redis-url") == store_env["LORASERVE_REDIS_URL"]
    assert _flag(gateway, "store") == "store:" + _flag(services["store"]["command"], "port")


def test_redis_keeps_the_registry_in_a_volume(compose: dict) -> None:
    """The registry is served from Redis: a restart keeps it (the store's copy in its data volume
    only restores what Redis lost). Its append-only file is fsynced every second, in its directory
    on a named volume, not in the container's own layer."""
    redis = compose["services"]["redis"]
    options = redis_server_options(redis["command"])
    assert {name: options.get(name) for name in DURABLE} == DURABLE
    (mount,) = [v for v in redis["volumes"] if v.split(":")[1] == options["dir"]]
    assert mount.split(":")[0] in compose["volumes"] and not mount.endswith(":ro")
    assert redis["restart"] == "unless-stopped"


@pytest.mark.redis
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_redis_run_as_composed_keeps_a_write_across_a_kill(compose: dict, tmp_path: Path) -> None:
    """redis-server with the compose file's options (in a directory of its own) is killed a second
    after a write (no shutdown save) and started again on the same directory: the write is there."""
    import redis as redis_py

    options = redis_server_options(compose["services"]["redis"]["command"])
    options.pop("dir")
    server = PrivateRedis(
        tmp_path, [word for name, value in options.items() for word in (f"--{name}", value)]
    )
    server.start()
    try:
        redis_py.Redis.from_url(server.url).set("loraserve:adapter:a", "{}")
        time.sleep(1.5)  # appendfsync everysec: on disk within a second
        server.stop()  # SIGKILL
        server.start()
        assert redis_py.Redis.from_url(server.url).get("loraserve:adapter:a") == b"{}"
    finally:
        server.stop()


def test_each_worker_has_its_own_gpu(compose: dict) -> None:
    gpus = []
    for name in WORKERS:
        (device,) = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and "count" not in device, name
        assert len(device["device_ids"]) == 1, name
        gpus += device["device_ids"]
    assert len(set(gpus)) == len(WORKERS), f"workers share a GPU: {gpus}"


def test_images_are_pinned(compose: dict) -> None:
    for name, service in compose["services"].items():
        if "build" in service:
            continue  # built here from docker/Dockerfile.*, whose bases test_images.py checks
        image = service["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag and re.search(r"\d", tag) and tag != "latest", (
            f"{name}: {image} is not pinned"
        )


def test_store_and_worker_commands_parse(compose: dict) -> None:
    store = compose["services"]["store"]
    assert store["command"][0] == "store"
    cfg = StoreConfig.from_args(store["command"][1:], env=_env(store))
    assert (cfg.host, cfg.port, cfg.redis_url) == ("0.0.0.0", 50051, "redis://redis:6379/0")
    assert cfg.s3_endpoint_url == "http://s3:5000"
    ids = set()
    for name in WORKERS:
        worker = compose["services"][name]
        assert worker["command"][0] == "worker"
        wcfg = WorkerConfig.from_args(worker["command"][1:], env=_env(worker))
        assert wcfg.store_address == f"store:{cfg.port}" and wcfg.redis_url == cfg.redis_url
        assert wcfg.device == "cuda" and wcfg.advertise_address == f"{name}:{wcfg.port}"
        ids.add(wcfg.worker_id)
    assert ids == set(WORKERS)


def test_store_state_is_on_volumes(compose: dict) -> None:
    """The data dir and the disk tier outlive the container, each on a writable volume of its own
    (the tier is a cache that can be dropped without the data)."""
    store = compose["services"]["store"]
    cfg = StoreConfig.from_args(store["command"][1:], env=_env(store))
    mounts = {}
    for spec in store["volumes"]:
        volume, path, *mode = spec.split(":")
        mounts[path] = (volume, mode)
    tier = cfg.payload_cache_dir
    assert tier is not None
    for path in (cfg.data_dir, str(tier)):
        volume, mode = mounts[path]
        assert volume in compose["volumes"] and mode != ["ro"], path
    assert mounts[cfg.data_dir][0] != mounts[str(tier)][0]


def test_the_handover_volume_is_the_stores_and_the_workers_read_it(compose: dict) -> None:
    """The store, running as its image's user (not root), makes its hand-over directory in a tmpfs
    volume: one mounted with mode 0755 and no uid is root's, and the store could not start. The
    workers mount that volume read-only at the same path and are given the same directory."""
    store = compose["services"]["store"]
    shared = Path(StoreConfig.from_args(store["command"][1:], env=_env(store)).handover_dir or "")
    mounts = [spec.split(":") for spec in store["volumes"]]
    ((volume, path, *mode),) = [m for m in mounts if shared.is_relative_to(m[1]) and shared != Path(m[1])]
    assert mode != ["ro"]
    opts = compose["volumes"][volume]["driver_opts"]
    options = dict(o.partition("=")[::2] for o in opts["o"].split(","))
    dockerfile = (COMPOSE.parent / "Dockerfile.store").read_text()
    (user,) = re.findall(r"^USER (\d+)$", dockerfile, re.M)
    assert opts["type"] == "tmpfs" and options["uid"] == user and int(options["mode"], 8) & 0o022 == 0
    for name in WORKERS:
        worker = compose["services"][name]
        cfg = WorkerConfig.from_args(worker["command"][1:], env=_env(worker))
        assert cfg.store_handover_dir == str(shared), name
        assert f"{volume}:{path}:ro" in worker["volumes"], name


def _loraserve_command(service: dict) -> tuple[str, list[str]] | None:
    """(subcommand, its arguments) of a service that runs the `loraserve` entry point, directly or
    in a shell line; None for anything else (redis, s3, the seed script)."""
    if "build" not in service:
        return None
    entrypoint = service.get("entrypoint")
    if entrypoint is None:
        return service["command"][0], service["command"][1:]
    if entrypoint[:2] == ["sh", "-c"]:
        m = re.search(r"\bloraserve (\w+) ([^;|&]*)", service["command"][0])
        assert m, service
        return m.group(1), m.group(2).split()
    return None


@pytest.mark.parametrize("name", ["store", "register", "gateway", *WORKERS])
def test_flags_and_variables_are_accepted(compose: dict, name: str) -> None:
    service = compose["services"][name]
    found = _loraserve_command(service)
    assert found is not None
    command, argv = found
    try:
        unknown = [f for f in flags_used(argv) if f not in cli_flags(command)]
    except UnknownCommand as exc:
        pytest.skip(str(exc))
    assert not unknown, f"{name}: `loraserve {command}` has no flag(s) {unknown}"
    assert not env_problems(command, list(service.get("environment") or {}), f"compose service {name}")


def test_health_checks_ask_the_served_port(compose: dict) -> None:
    services = compose["services"]
    for name, expected in (("store", STORE_SERVICE), *((w, WORKER_SERVICE) for w in WORKERS)):
        service = services[name]
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "loraserve", "health"], name
        assert test[3] == f"127.0.0.1:{_flag(service['command'], 'port')}", name
        assert _flag(test, "service") == expected, name
    gateway = services["gateway"]
    url = f"http://127.0.0.1:{_flag(gateway['command'], 'port')}/health"
    assert url in " ".join(gateway["healthcheck"]["test"])
    for job in ("seed", "register"):
        assert services[job]["healthcheck"] == {"disable": True}, job


def _seconds(duration: str) -> float:
    m = re.fullmatch(r"(\d+)s", duration)
    assert m, duration
    return float(m.group(1))


def test_stop_grace_covers_the_drain(compose: dict) -> None:
    for name, config in (("store", StoreConfig), *((w, WorkerConfig) for w in WORKERS)):
        service = compose["services"][name]
        grace = config.from_args(service["command"][1:], env=_env(service)).grace_period_s
        assert _seconds(service["stop_grace_period"]) >= grace + 10, name


def test_workers_have_shared_memory_for_the_fetch_process(compose: dict) -> None:
    """Docker's default /dev/shm (64 MiB) holds less than one 8B-shaped adapter payload."""
    for name in WORKERS:
        service = compose["services"][name]
        assert WorkerConfig.from_args(service["command"][1:], env=_env(service)).fetch_process, name
        size = str(service["shm_size"])
        m = re.fullmatch(r"(\d+)(gb|mb)", size)
        assert m, size
        assert int(m.group(1)) * (1024 if m.group(2) == "gb" else 1) >= 1024, name


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
    res = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
