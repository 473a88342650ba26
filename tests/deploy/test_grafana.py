"""The Grafana dashboard in deploy/grafana parses, lays its panels out once each, and queries only
series that the services export (names read from their real metric registries)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from loraserve.adapter_store.metrics import StoreMetrics
from loraserve.gateway.metrics import GatewayMetrics
from loraserve.inference_worker.adapters.metrics import AdapterMetrics
from loraserve.inference_worker.engine.device_timing import DeviceTiming
from loraserve.inference_worker.metrics import WorkerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "loraserve.json"
METRIC_NAME = re.compile(r"\bloraserve_[a-z0-9_]+")
# the sample names of a family, by its type (what Prometheus stores)
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
}


class _IdleEngine:
    num_waiting = num_running = num_free_blocks = 0
    timing = DeviceTiming(on_cuda=False)


def exported_series() -> dict[str, set[str]]:
    """sample name -> its label names, for every metric of the store, the worker and the gateway."""
    worker = WorkerMetrics(_IdleEngine())
    try:
        AdapterMetrics(CollectorRegistry()).register_on(worker.registry)
        out: dict[str, set[str]] = {}
        for registry in (worker.registry, StoreMetrics().registry, GatewayMetrics().registry):
            for family in registry.collect():
                labels = set(getattr(registry._names_to_collectors.get(family.name), "_labelnames", ()))
                if family.name.startswith("loraserve_worker_per_adapter_resident"):
                    labels = {"adapter", "tier"}
                for suffix in SUFFIXES[family.type]:
                    out[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
        return out
    finally:
        worker.close()  # (its collector timing hook)


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _graph_panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_panels_have_unique_ids_and_do_not_overlap(dashboard: dict) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
    assert dashboard["templating"]["list"][0]["type"] == "datasource"


def test_queries_name_only_exported_series_and_their_labels(dashboard: dict) -> None:
    series = exported_series()
    used: set[str] = set()
    for panel in _graph_panels(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            names = METRIC_NAME.findall(expr)
            assert names, expr
            for name in names:
                assert name in series, f"{panel['title']!r} queries {name}, which no service exports"
                used.add(name)
            # every label grouped by or matched on is one the series carry (or Prometheus adds)
            grouped = {g.strip() for by in re.findall(r"by \(([^)]*)\)", expr) for g in by.split(",")}
            matched = set(re.findall(r"([a-z_]+)\s*(?:=|!=|=~|!~)\s*\"", expr))
            known = set().union(*(series[n] for n in names)) | {"instance", "job"}
            assert grouped | matched <= known, (panel["title"], (grouped | matched) - known)
    # the dashboard shows every per-adapter series
    per_adapter = {n for n in series if n.startswith("loraserve_worker_per_adapter_")}
    assert per_adapter <= used, per_adapter - used
