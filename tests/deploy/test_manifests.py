"""deploy/kubernetes renders (our renderer, and kubectl's kustomize where installed) to objects that
validate against the Kubernetes API schemas (kubernetes-validate's bundled copies, strict: unknown
fields fail) of the oldest Kubernetes the base supports and of the newest one bundled."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.helpers.kustomize import UnsupportedKustomization, render

# native gRPC probes are GA from 1.27; 1.28 is the oldest release the base is checked against
VERSIONS = ("1.28", kubernetes_validate.latest_version())


def _errors(objects: list[dict], version: str) -> list[str]:
    errors = []
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{where} ({version}): {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{where} ({version}): {exc.message}")
    return errors


@pytest.mark.parametrize("version", VERSIONS)
def test_objects_match_the_kubernetes_schemas(rendered: list[dict], version: str) -> None:
    assert not _errors(rendered, version)


def _worker_set(rendered: list[dict]) -> dict:
    return copy.deepcopy(
        next(
            o for o in rendered if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "loraserve-worker"
        )
    )


def test_worker_has_shared_memory_for_the_fetch_process(rendered: list[dict]) -> None:
    """The runtime's default /dev/shm (64 MiB) holds less than one 8B-shaped adapter payload."""
    pod = _worker_set(rendered)["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "worker"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert volume["emptyDir"]["sizeLimit"].endswith("Gi")


def test_the_schema_check_rejects_broken_objects(rendered: list[dict]) -> None:
    misspelt = _worker_set(rendered)
    misspelt["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    (error,) = _errors([misspelt], VERSIONS[-1])
    assert "terminationGracePeriod" in error
    named_port = _worker_set(rendered)  # gRPC probes take a port number, not a port name
    named_port["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    (error,) = _errors([named_port], VERSIONS[0])
    assert "readinessProbe.grpc.port" in error


def test_the_renderer_refuses_what_it_does_not_render(base_dir: Path, tmp_path: Path) -> None:
    copy_dir = tmp_path / "base"
    shutil.copytree(base_dir, copy_dir)
    kustomization = yaml.safe_load((copy_dir / "kustomization.yaml").read_text())
    kustomization["namePrefix"] = "prod-"
    (copy_dir / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    with pytest.raises(UnsupportedKustomization, match="namePrefix"):
        render(copy_dir)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_renders_the_same(base_dir: Path, rendered: list[dict]) -> None:
    res = subprocess.run(["kubectl", "kustomize", str(base_dir)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    theirs = [doc for doc in yaml.safe_load_all(res.stdout) if doc]

    def key(obj: dict) -> tuple[str, str]:
        return obj["kind"], obj["metadata"]["name"]

    assert sorted(map(key, theirs)) == sorted(map(key, rendered))
    ours = {key(o): o for o in rendered}
    for obj in theirs:
        assert obj == ours[key(obj)], key(obj)
