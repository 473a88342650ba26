"""Renders the kustomize base in deploy/kubernetes as `kubectl kustomize` does, for the fields that
base uses: resources, namespace, and a secretGenerator from env files with no name hash. Any other
field is refused, so the base cannot outgrow this renderer unnoticed; where kubectl is installed,
tests/deploy compares the two outputs."""

from __future__ import annotations

import base64
import copy
from pathlib import Path

import yaml

FIELDS = frozenset({"apiVersion", "kind", "namespace", "resources", "secretGenerator"})
GENERATOR_FIELDS = frozenset({"name", "envs", "options"})
# kinds outside any namespace: the namespace field must not touch them
CLUSTER_SCOPED = frozenset(
    {
        "Namespace",
        "PersistentVolume",
        "StorageClass",
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "PriorityClass",
        "RuntimeClass",
    }
)


class UnsupportedKustomization(ValueError):
    pass


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines; blank lines and lines starting with # are skipped."""
    data: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key, sep, value = stripped.partition("=")
        if not sep or not key:
            raise UnsupportedKustomization(f"{path}:{number}: expected KEY=VALUE")
        data[key] = value
    return data


def _secret(generator: dict, directory: Path) -> dict:
    unknown = set(generator) - GENERATOR_FIELDS
    if unknown or generator.get("options") != {"disableNameSuffixHash": True}:
        raise UnsupportedKustomization(
            f"secretGenerator {generator.get('name')}: only name, envs and "
            f"options.disableNameSuffixHash: true are rendered here"
        )
    data: dict[str, str] = {}
    for env in generator["envs"]:
        data.update(read_env_file(directory / env))
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": generator["name"]},
        "type": "Opaque",
        "data": encoded,
    }


def render(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - FIELDS
    if unknown:
        raise UnsupportedKustomization(f"kustomization fields not rendered here: {sorted(unknown)}")
    objects: list[dict] = []
    for resource in kustomization.get("resources", []):
        objects += [
            copy.deepcopy(doc) for doc in yaml.safe_load_all((directory / resource).read_text()) if doc
        ]
    objects += [_secret(g, directory) for g in kustomization.get("secretGenerator", [])]
    namespace = kustomization.get("namespace")
    for obj in objects:
        if namespace and obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = namespace
    return objects
