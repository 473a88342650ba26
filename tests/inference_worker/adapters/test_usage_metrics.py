"""Per-adapter metrics stay bounded however many adapters are in use: the most used K keep their
own label, the rest are counted as "other", and a demoted adapter's series go away."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from loraserve.inference_worker.adapters.usage_metrics import AdapterUsageMetrics
from loraserve.serving.top_labels import OTHER, TopLabels

K = 20
NUM_ADAPTERS = 1000


def _label_values(registry: CollectorRegistry) -> dict[str, set[str]]:
    """metric family -> adapter label values among its samples."""
    out: dict[str, set[str]] = {}
    for family in registry.collect():
        if family.name.startswith("loraserve_worker_per_adapter_"):
            out[family.name] = {s.labels["adapter"] for s in family.samples}
    return out


def test_cardinality_stays_bounded_with_1000_adapters_in_use() -> None:
    registry = CollectorRegistry()
    usage = AdapterUsageMetrics(registry, top_k=K)
    names = [f"tenant-{i:04d}" for i in range(NUM_ADAPTERS)]
    usage.residents = lambda: [(n, "cpu") for n in names] + [(n, "gpu") for n in names[:8]]
    rng = random.Random(0)
    # Zipf-like popularity: adapter i is used about 1 / (i + 1) as often as adapter 0
    weights = [1 / (i + 1) for i in range(NUM_ADAPTERS)]
    stream = rng.choices(names, weights, k=30_000) + names  # and every adapter at least once
    rng.shuffle(stream)
    for i, name in enumerate(stream):
        code = "OK" if i % 10 else "NOT_FOUND"
        ref = f"{name}@{'a' * 64}" if i % 3 == 0 else name
        usage.arrived(ref)
        usage.observe_request(ref, code)
        if code == "OK":
            usage.observe_tokens(name, 12, 5)
        if i % 7 == 0:
            usage.observe_load(name, "cpu" if i % 2 else "gpu", 0.01)

    values = _label_values(registry)
    assert set(values) == {
        "loraserve_worker_per_adapter_requests",
        "loraserve_worker_per_adapter_prompt_tokens",
        "loraserve_worker_per_adapter_generated_tokens",
        "loraserve_worker_per_adapter_load_seconds",
        "loraserve_worker_per_adapter_resident",
    }
    for name, labels in values.items():
        assert len(labels) <= K + 1, (name, len(labels))
        assert OTHER in labels, name
    total_samples = sum(len(f.samples) for f in registry.collect())
    assert total_samples <= (K + 1) * 40  # requests x 2 codes (+created), tokens, load x 2 tiers, ...
    # the most used adapters are the ones labelled, and the counts still add up per series kept
    assert set(names[:5]) <= usage.labels.labelled
    assert usage.labels.num_tracked <= usage.labels.max_tracked
    (resident,) = _families(registry, "resident")
    by_tier = {t: sum(s.value for s in resident.samples if s.labels["tier"] == t) for t in ("cpu", "gpu")}
    assert by_tier == {"cpu": NUM_ADAPTERS, "gpu": 8}


def _families(registry: CollectorRegistry, suffix: str):
    return [f for f in registry.collect() if f.name == f"loraserve_worker_per_adapter_{suffix}"]


def test_a_demoted_adapter_loses_its_series() -> None:
    registry = CollectorRegistry()
    usage = AdapterUsageMetrics(registry, top_k=2)
    for name in ("a", "b"):
        usage.arrived(name)
        usage.observe_request(name, "OK")
        usage.observe_tokens(name, 1, 1)
    for _ in range(5):
        usage.arrived("c")
        usage.observe_request("c", "OK")  # 5 uses against 1: takes the least used one's label
    labelled = usage.labels.labelled
    assert "c" in labelled and len(labelled) == 2
    (demoted,) = {"a", "b"} - labelled
    value = registry.get_sample_value
    assert value("loraserve_worker_per_adapter_requests_total", {"adapter": demoted, "code": "OK"}) is None
    assert value("loraserve_worker_per_adapter_prompt_tokens_total", {"adapter": demoted}) is None
    # c's first two uses (before it had a label) went to other; from the promotion on, its own
    assert value("loraserve_worker_per_adapter_requests_total", {"adapter": OTHER, "code": "OK"}) == 2
    assert value("loraserve_worker_per_adapter_requests_total", {"adapter": "c", "code": "OK"}) == 3


class _SignallingLock:
    """A lock that sets `waiting` when a thread finds it taken (and then blocks on it)."""

    def __init__(self, waiting: threading.Event) -> None:
        self._lock, self._waiting = threading.Lock(), waiting

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self._waiting.set()
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


@pytest.mark.parametrize("hooked", ["peek", "labels"])
def test_a_demotion_between_label_lookup_and_series_creation_leaves_no_series(
    monkeypatch: pytest.MonkeyPatch, hooked: str
) -> None:
    """The engine step thread observes a load of "a" while the event loop demotes "a": the demotion
    runs exactly after the label is read (peek) or exactly before the series is created (labels),
    and either removes that series or sends the sample to other; no series of "a" stays."""
    registry = CollectorRegistry()
    usage = AdapterUsageMetrics(registry, top_k=1)
    usage.arrived("a")
    usage.arrived("c")
    usage.arrived("c")  # one more use of c takes a's label
    progress = threading.Event()  # the demotion finished, or waits for the observer's lock
    usage._lock = _SignallingLock(progress)  # type: ignore[assignment]

    def demote() -> None:
        usage.arrived("c")
        progress.set()

    demoter = threading.Thread(target=demote)
    owner: Any = usage.labels if hooked == "peek" else usage.load_seconds
    original = getattr(owner, hooked)

    def hook(*args: str) -> Any:
        result = original(*args) if hooked == "peek" else None  # after the lookup, before creation
        if demoter.ident is None:  # once: in the first observation
            demoter.start()
            assert progress.wait(10)
        return result if hooked == "peek" else original(*args)

    monkeypatch.setattr(owner, hooked, hook)
    usage.observe_load("a", "gpu", 0.5)
    demoter.join(10)
    assert not demoter.is_alive() and usage.labels.labelled == {"c"}
    usage.observe_load("a", "gpu", 0.25)  # a's samples go to other from now on

    value = registry.get_sample_value
    assert value("loraserve_worker_per_adapter_load_seconds_count", {"adapter": "a", "tier": "gpu"}) is None
    assert _label_values(registry)["loraserve_worker_per_adapter_load_seconds"] == {OTHER}
    assert value("loraserve_worker_per_adapter_load_seconds_sum", {"adapter": OTHER, "tier": "gpu"}) == 0.25


def test_labels_have_hysteresis_and_bounded_memory() -> None:
    top = TopLabels(1, max_tracked=16)
    assert top.label("a") == "a"
    assert top.label("b") == OTHER and top.label("b") == OTHER  # 2 uses: not more than twice a's 1
    assert top.label("b") == "b" and top.peek("a") == OTHER  # 3 > 2 x 1
    for i in range(1000):
        top.label(f"x{i}")
    assert top.num_tracked <= 16 and top.peek("b") == "b"
    assert top.label("other") == OTHER  # the catch-all is never an adapter's own label


def test_malformed_adapter_ids_never_become_label_values() -> None:
    registry = CollectorRegistry()
    usage = AdapterUsageMetrics(registry, top_k=4)
    usage.arrived("bad id\n" + "x" * 10_000)
    usage.observe_request("bad id\n" + "x" * 10_000, "INVALID_ARGUMENT")
    assert _label_values(registry)["loraserve_worker_per_adapter_requests"] == {OTHER}
