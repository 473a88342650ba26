"""What the workers' Prometheus metrics say happened during a run: scrape each `/metrics` before and
after, and take the difference of the adapter counters (loads by tier, evictions by tier, admission
lookups by where the adapter was found, mean load time by tier) summed over the workers. Names follow
inference_worker/adapters/metrics.py; a fetch from the store is a load into the CPU tier. A store's
metrics among them add where its fetches' payloads came from (adapter_store/metrics.py)."""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

Sample = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)

LOADS = "loraserve_worker_adapter_loads_total"
EVICTIONS = "loraserve_worker_adapter_evictions_total"
LOOKUPS = "loraserve_worker_adapter_lookups_total"
GENERATED = "loraserve_worker_generated_tokens_total"
STEP_SEQUENCES = "loraserve_worker_step_sequences"  # histogram: _count, _sum
STEP_ADAPTERS = "loraserve_worker_step_adapters"  # histogram: distinct adapters of a step's rows
STEP_SECONDS = "loraserve_worker_step_seconds"  # histogram by kind: _count, _sum
STEP_ADMISSIONS = "loraserve_worker_step_admissions_total"  # steps by what ended their admission
DEVICE_WAIT = "loraserve_worker_device_wait_seconds_total"
STEP_DEVICE_SECONDS = "loraserve_worker_step_device_seconds"  # histogram of one step in 16
LOAD_SECONDS = "loraserve_worker_adapter_load_seconds"  # histogram by tier: _count, _sum
GC_PAUSE = "loraserve_worker_gc_pause_seconds"  # histogram by generation: _count, _sum, _bucket
GC_CPU = "loraserve_worker_gc_cpu_seconds"  # the collecting thread's CPU time, as GC_PAUSE
LONG_GC_PAUSE = "0.01"  # the bucket bound above which a collection counts as long (seconds)
# a store's metrics among the URLs: where its fetches' payloads came from (memory, disk, source)
STORE_OPEN_SECONDS = "loraserve_store_fetch_open_seconds"


def metrics_url(url: str) -> str:
    """`host:port` or a URL without a path means its /metrics."""
    if "://" not in url:
        url = "http://" + url
    scheme, rest = url.split("://", 1)
    return url if "/" in rest else f"{scheme}://{rest}/metrics"


def parse(text: str) -> dict[Sample, float]:
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError as exc:
        raise RuntimeError(
            "reading worker metrics needs prometheus-client: pip install 'loraserve[bench]'"
        ) from exc
    return {
        (s.name, tuple(sorted(s.labels.items()))): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(url: str, timeout: float = 5.0) -> dict[Sample, float]:
    url = metrics_url(url)
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"metrics URL must be http(s), got {url!r}")
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return parse(r.read().decode("utf-8"))


def scrape_all(urls: Sequence[str]) -> list[dict[Sample, float]]:
    return [scrape(u) for u in urls]


def _per_step_ms(seconds: float, steps: int) -> float | None:
    return round(1e3 * seconds / steps, 3) if steps else None


@dataclass(frozen=True)
class AdapterActivity:
    loads: dict[str, int]  # successful loads by tier: cpu = fetched from the store, gpu = into a slot
    failed_loads: dict[str, int]  # by tier
    evictions: dict[str, int]  # by tier
    lookups: dict[str, int]  # admission lookups by where the adapter was: gpu, cpu, miss
    generated_tokens: int
    steps: int = 0  # engine steps that ran the model, summed over the workers
    step_sequences: int = 0  # sequences over those steps (their mean is how full batches were)
    step_adapters: int = 0  # distinct adapters of each step's rows, summed over those steps
    load_ms: dict[str, float] = field(default_factory=dict)  # mean ms of a load, by tier
    store_origins: dict[str, int] = field(default_factory=dict)  # a store's fetches by origin
    step_seconds: float = 0.0  # wall time of those steps (the step thread's, waits included)
    device_wait_seconds: float = 0.0  # of which the step thread waited for the device
    device_seconds: float = 0.0  # device time of the timed steps (one in 16, CUDA) ...
    device_steps: int = 0  # ... and their count
    gc_collections: dict[str, int] = field(default_factory=dict)  # by generation
    gc_ms: dict[str, float] = field(default_factory=dict)  # their total duration, by generation
    # ... and the collecting thread's CPU time in them (the duration also counts another thread's
    # turn with the interpreter before a collection's end is timed: loraserve/serving/gc_tuning.py)
    gc_cpu_ms: dict[str, float] = field(default_factory=dict)
    gc_long: int = 0  # collections over 10 ms (no thread of the worker ran Python meanwhile)
    # steps by what ended their admission pass (queue_empty, max_num_seqs, adapter_wait, ...): with
    # batches below max_num_seqs, whether requests waited in the engine or were elsewhere
    step_admissions: dict[str, int] = field(default_factory=dict)

    @property
    def store_fetches(self) -> int:
        return self.loads.get("cpu", 0)

    def as_dict(self) -> dict[str, object]:
        return {
            "loads": self.loads,
            "failed_loads": self.failed_loads,
            "evictions": self.evictions,
            "store_fetches": self.store_fetches,
            "lookups": self.lookups,
            "generated_tokens": self.generated_tokens,
            "steps": self.steps,
            "mean_sequences_per_step": round(self.step_sequences / self.steps, 2) if self.steps else None,
            "mean_adapters_per_step": round(self.step_adapters / self.steps, 2) if self.steps else None,
            "mean_load_ms": self.load_ms,
            "store_fetch_origins": self.store_origins,
            "step_ms": _per_step_ms(self.step_seconds, self.steps),
            "device_wait_ms_per_step": _per_step_ms(self.device_wait_seconds, self.steps),
            "device_ms_per_step": _per_step_ms(self.device_seconds, self.device_steps),
            "gc_collections": self.gc_collections,
            "gc_ms": self.gc_ms,
            "gc_cpu_ms": self.gc_cpu_ms,
            "gc_over_10ms": self.gc_long,
            "step_admissions": self.step_admissions,
        }


def _by_label(
    before: Mapping[Sample, float],
    after: Mapping[Sample, float],
    name: str,
    label: str,
    exact: bool = False,
    **where: str,
) -> dict[str, float]:
    """The change of `name` by the value of `label` (rounded to counts unless `exact`)."""
    out: dict[str, float] = {}
    for (sample, labels), value in after.items():
        if sample != name:
            continue
        d = dict(labels)
        if any(d.get(k) != v for k, v in where.items()) or label not in d:
            continue
        delta = value - before.get((sample, labels), 0.0)
        out[d[label]] = out.get(d[label], 0) + (delta if exact else round(delta))
    return out


def _sum_float(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


def _sum(parts: Sequence[dict[str, float]]) -> dict[str, int]:
    return {k: round(v) for k, v in _sum_float(parts).items()}


def activity(
    before: Sequence[Mapping[Sample, float]], after: Sequence[Mapping[Sample, float]]
) -> AdapterActivity:
    """The adapter activity between two scrapes of the same workers (in the same order)."""
    pairs = list(zip(before, after, strict=True))

    def exact(name: str) -> float:
        return sum(a.get((name, ()), 0.0) - b.get((name, ()), 0.0) for b, a in pairs)

    def delta(name: str) -> int:  # a count
        return round(exact(name))

    def by(name: str, label: str) -> dict[str, int]:
        """The change of `name` by `label`, summed over the workers: counts."""
        return _sum([_by_label(b, a, name, label) for b, a in pairs])

    def by_exact(name: str, label: str) -> dict[str, float]:
        return _sum_float([_by_label(b, a, name, label, exact=True) for b, a in pairs])

    every = [_by_label(b, a, LOADS, "tier") for b, a in pairs]
    ok = [_by_label(b, a, LOADS, "tier", result="ok") for b, a in pairs]
    failed = [
        {t: n - o.get(t, 0) for t, n in e.items() if n > o.get(t, 0)} for e, o in zip(every, ok, strict=True)
    ]
    loads_n = by(LOAD_SECONDS + "_count", "tier")
    gc_n = by(GC_PAUSE + "_count", "generation")
    gc_short = by(GC_PAUSE + "_bucket", "le")  # (a bucket summed over the generations: up to its bound)
    gc_s = by_exact(GC_PAUSE + "_sum", "generation")
    gc_cpu_s = by_exact(GC_CPU + "_sum", "generation")
    loads_s = by_exact(LOAD_SECONDS + "_sum", "tier")
    return AdapterActivity(
        loads=_sum(ok),
        failed_loads=_sum(failed),
        evictions=by(EVICTIONS, "tier"),
        lookups=by(LOOKUPS, "result"),
        generated_tokens=delta(GENERATED),
        steps=delta(STEP_SEQUENCES + "_count"),
        step_sequences=delta(STEP_SEQUENCES + "_sum"),
        step_adapters=delta(STEP_ADAPTERS + "_sum"),
        load_ms={t: round(1e3 * loads_s.get(t, 0.0) / n, 2) for t, n in loads_n.items() if n},
        store_origins=by(STORE_OPEN_SECONDS + "_count", "origin"),
        step_seconds=sum(by_exact(STEP_SECONDS + "_sum", "kind").values()),
        device_wait_seconds=exact(DEVICE_WAIT),
        device_seconds=exact(STEP_DEVICE_SECONDS + "_sum"),
        device_steps=delta(STEP_DEVICE_SECONDS + "_count"),
        gc_collections={g: n for g, n in gc_n.items() if n},
        gc_ms={g: round(1e3 * v, 2) for g, v in gc_s.items() if gc_n.get(g)},
        gc_cpu_ms={g: round(1e3 * v, 2) for g, v in gc_cpu_s.items() if gc_n.get(g)},
        gc_long=sum(gc_n.values()) - gc_short.get(LONG_GC_PAUSE, 0),
        step_admissions={k: n for k, n in by(STEP_ADMISSIONS, "outcome").items() if n},
    )
