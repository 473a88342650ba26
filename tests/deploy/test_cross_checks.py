"""What the schemas cannot see in deploy/kubernetes: every flag and LORASERVE_* variable is one the
command reads and its config accepts, addresses name Services that exist, Services, container ports,
probes and the commands' --port agree, the termination grace covers the drain, one GPU per worker,
secret keys exist, volumes and claims resolve, Redis keeps the registry on a claim."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

from loraserve.adapter_store.config import StoreConfig
from loraserve.inference_worker.config import WorkerConfig
from loraserve.v1 import store_pb2, worker_pb2
from tests.helpers.cli_env import UnknownCommand, cli_flags, env_problems, flags_used
from tests.helpers.kustomize import read_env_file
from tests.helpers.redis_options import DURABLE, redis_server_options

GRPC_SERVICE = {
    "store": store_pb2.DESCRIPTOR.services_by_name["AdapterStore"].full_name,
    "worker": worker_pb2.DESCRIPTOR.services_by_name["InferenceWorker"].full_name,
}
CONFIGS = {"store": StoreConfig, "worker": WorkerConfig}
COMPONENTS = ("store", "worker", "gateway")
DRAIN_MARGIN_S = 10  # stopping the engine and releasing Redis keys after the grace period


def _of_kind(rendered: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in rendered if o["kind"] == kind}


def _workloads(rendered: list[dict]) -> list[dict]:
    return [o for o in rendered if o["kind"] in ("Deployment", "StatefulSet")]


def _component(rendered: list[dict], component: str) -> tuple[dict, dict]:
    """(workload, its loraserve container)."""
    (workload,) = [
        w
        for w in _workloads(rendered)
        if w["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return workload, container


def _env(container: dict, rendered: list[dict], pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env, with
    $(VAR) expanded; secrets and pod fields stand in as placeholders."""
    configmaps = _of_kind(rendered, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(configmaps[source["configMapRef"]["name"]]["data"])
    fields = {"metadata.name": pod_name, "metadata.namespace": rendered[0]["metadata"]["namespace"]}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], var["value"])
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = f"secret-{ref['name']}-{ref['key']}"
        else:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def _names_set(container: dict, rendered: list[dict]) -> list[str]:
    configmaps = _of_kind(rendered, "ConfigMap")
    names = [v["name"] for v in container.get("env", [])]
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            names += list(configmaps[source["configMapRef"]["name"]]["data"])
    return names


def _config(rendered: list[dict], component: str):
    workload, container = _component(rendered, component)
    env = _env(container, rendered, f"{workload['metadata']['name']}-0")
    return CONFIGS[component].from_args(container["args"][1:], env=env)


def _flag(argv: list[str], name: str) -> int:
    return int(argv[argv.index(f"--{name}") + 1])


def _container_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


@pytest.mark.parametrize("component", COMPONENTS)
def test_flags_and_variables_are_accepted(rendered: list[dict], component: str) -> None:
    _, container = _component(rendered, component)
    command, argv = container["args"][0], container["args"][1:]
    names = _names_set(container, rendered)
    assert len(names) == len(set(names)), f"{component}: a variable is set twice: {sorted(names)}"
    assert all(n.startswith("LORASERVE_") or n in ("POD_NAME", "POD_NAMESPACE") for n in names), names
    try:
        unknown = [f for f in flags_used(argv) if f not in cli_flags(command)]
    except UnknownCommand as exc:
        pytest.skip(str(exc))
    assert not unknown, f"{component}: `loraserve {command}` has no flag(s) {unknown}"
    assert not env_problems(command, names, f"{component} container")


def test_store_and_worker_configs_parse(rendered: list[dict]) -> None:
    store, worker = _config(rendered, "store"), _config(rendered, "worker")
    assert store.admin_token and worker.store_token and worker.admin_token
    assert worker.device == "cuda" and worker.worker_id == "loraserve-worker-0"
    assert Path(store.base_model) == Path(worker.model)
    host, port = worker.advertise_address.rsplit(":", 1)
    pod, service, namespace, svc = host.split(".")
    assert (pod, svc, int(port)) == ("loraserve-worker-0", "svc", worker.port)
    headless = _of_kind(rendered, "Service")[service]
    statefulset, _ = _component(rendered, "worker")
    assert headless["spec"]["clusterIP"] == "None" and statefulset["spec"]["serviceName"] == service


def _service_port(rendered: list[dict], host: str, port: int) -> None:
    service = _of_kind(rendered, "Service").get(host)
    assert service is not None, f"no Service {host}"
    assert port in [p["port"] for p in service["spec"]["ports"]], f"Service {host} has no port {port}"


def test_addresses_name_services(rendered: list[dict]) -> None:
    addresses = []
    for component in COMPONENTS:
        workload, container = _component(rendered, component)
        env = _env(container, rendered, f"{workload['metadata']['name']}-0")
        for name in ("LORASERVE_STORE_ADDRESS", "LORASERVE_STORE", "LORASERVE_WORKER"):
            if name in env:
                addresses.append(env[name])
        if "LORASERVE_REDIS_URL" in env:
            m = re.fullmatch(r"redis://([\w.-]+):(\d+)/\d+", env["LORASERVE_REDIS_URL"])
            assert m, env["LORASERVE_REDIS_URL"]
            addresses.append(f"{m.group(1)}:{m.group(2)}")
    assert len(addresses) == 6
    for address in addresses:
        host, port = address.rsplit(":", 1)
        _service_port(rendered, host, int(port))


def test_services_reach_container_ports(rendered: list[dict]) -> None:
    for name, service in _of_kind(rendered, "Service").items():
        selector = service["spec"]["selector"]
        targets = [
            w
            for w in _workloads(rendered)
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(targets) == 1, f"Service {name} selects {len(targets)} workloads"
        ports = {
            p["name"]: p["containerPort"]
            for c in targets[0]["spec"]["template"]["spec"]["containers"]
            for p in c["ports"]
        }
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            number = ports.get(target) if isinstance(target, str) else target
            assert number in ports.values(), f"Service {name} port {port['name']}: no container port {target}"
            assert port["port"] == number, f"Service {name} port {port['name']} differs from the container's"


def test_selectors_match_their_templates(rendered: list[dict]) -> None:
    for workload in _workloads(rendered):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items(), workload["metadata"][
            "name"
        ]


def test_ports_and_probes_agree_with_the_commands(rendered: list[dict]) -> None:
    for component in ("store", "worker"):
        _, container = _component(rendered, component)
        port = _config(rendered, component).port
        assert _container_ports(container) == {
            "grpc": port,
            "metrics": _flag(container["args"], "metrics-port"),
        }
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": port, "service": GRPC_SERVICE[component]}, (
                component,
                probe,
            )
    _, gateway = _component(rendered, "gateway")
    port = _flag(gateway["args"], "port")
    assert _container_ports(gateway) == {"http": port}
    for probe in ("readinessProbe", "livenessProbe"):
        assert gateway[probe]["httpGet"] == {"path": "/health", "port": port}, probe


@pytest.mark.parametrize("component", ["store", "worker"])
def test_termination_grace_covers_the_drain(rendered: list[dict], component: str) -> None:
    workload, _ = _component(rendered, component)
    grace = _config(rendered, component).grace_period_s
    assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= grace + DRAIN_MARGIN_S


def test_one_gpu_per_worker_and_a_disruption_budget(rendered: list[dict]) -> None:
    for component in COMPONENTS:
        _, container = _component(rendered, component)
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu", 0)
        assert gpus == (1 if component == "worker" else 0), component
    (budget,) = _of_kind(rendered, "PodDisruptionBudget").values()
    workers, _ = _component(rendered, "worker")
    assert budget["spec"]["selector"] == workers["spec"]["selector"]
    assert budget["spec"]["maxUnavailable"] == 1 and workers["spec"]["replicas"] >= 2


def test_secret_keys_exist(rendered: list[dict], base_dir: Path) -> None:
    (secret,) = _of_kind(rendered, "Secret").values()
    example = read_env_file(base_dir / "tokens.env.example")
    assert set(secret["data"]) == set(example)
    used: dict[str, str] = {}
    for component in COMPONENTS:
        _, container = _component(rendered, component)
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == secret["metadata"]["name"] and ref["key"] in example, var
                used[var["name"]] = ref["key"]
    assert used == {
        "LORASERVE_ADMIN_TOKEN": "admin-token",
        "LORASERVE_READ_TOKEN": "read-token",
        "LORASERVE_STORE_TOKEN": "read-token",
        "LORASERVE_API_KEY": "api-key",
    }


def test_volumes_and_claims_resolve(rendered: list[dict]) -> None:
    claims = set(_of_kind(rendered, "PersistentVolumeClaim"))
    for workload in _workloads(rendered):
        spec = workload["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        templates = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, volume
        for container in spec["containers"]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in templates, (
                    workload["metadata"]["name"],
                    mount,
                )
    for component, path in (
        ("store", _config(rendered, "store").base_model),
        ("worker", _config(rendered, "worker").model),
    ):
        _, container = _component(rendered, component)
        assert any(path.startswith(m["mountPath"] + "/") for m in container["volumeMounts"]), (
            component,
            path,
        )


def test_store_state_is_on_writable_claims(rendered: list[dict]) -> None:
    """The root filesystem is read-only: the data dir and the disk tier must be mounted claims, each
    its own, and the tier's byte bound must fit its claim."""
    store = _config(rendered, "store")
    workload, container = _component(rendered, "store")
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    claims = _of_kind(rendered, "PersistentVolumeClaim")
    tier = store.payload_cache_dir
    assert tier is not None
    claim_of = {}
    for path in (store.data_dir, str(tier)):
        mount = mounts[path]
        assert not mount.get("readOnly"), path
        claim_of[path] = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
    assert claim_of[store.data_dir] != claim_of[str(tier)]
    size = claims[claim_of[str(tier)]]["spec"]["resources"]["requests"]["storage"]
    assert size.endswith("Gi") and store.cache_dir_max_bytes < int(size[:-2]) << 30


def test_redis_keeps_the_registry_on_a_claim(rendered: list[dict]) -> None:
    """The registry is served from Redis: its append-only file, fsynced every second, is in a
    directory on a claim of its pod's own (a StatefulSet's template), which outlives the pod."""
    workload, container = _component(rendered, "redis")
    assert workload["kind"] == "StatefulSet" and "command" not in container
    options = redis_server_options(container["args"])
    assert {name: options.get(name) for name in DURABLE} == DURABLE
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == options["dir"]]
    assert not mount.get("readOnly")
    (claim,) = [t for t in workload["spec"]["volumeClaimTemplates"] if t["metadata"]["name"] == mount["name"]]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"].endswith("Gi")


def test_images_are_this_release(rendered: list[dict]) -> None:
    version = importlib.metadata.version("loraserve")
    expected = {"store": "loraserve-cpu", "worker": "loraserve-gpu", "gateway": "loraserve-cpu"}
    for component, image in expected.items():
        _, container = _component(rendered, component)
        assert container["image"] == f"{image}:{version}", component
    for workload in _workloads(rendered):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            assert re.search(r":\d+\.\d+\.\d+", container["image"]), container["image"]
