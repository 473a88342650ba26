"""What the serving benchmark (bench_serving.py) reports of its runs: the device's name, the share
of requests that found their adapter resident, what a fleet's holdings could serve, and one line
per N."""

from __future__ import annotations

from collections.abc import Sequence

from loraserve.clients.bench.workload import zipf_weights


def device_name(device: str) -> str:
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


def store_share(summary: dict) -> float | None:
    """Requests whose adapter had to come from the store, over requests with an adapter."""
    resident = resident_share(summary)
    return None if resident is None else round(1.0 - resident, 4)


def still_warming(before: float | None, now: float | None, floor: float = 0.02, drop: float = 0.75) -> bool:
    """Whether another warm-up period is worth running: the share of requests whose adapter came
    from the store is still above `floor` and fell by more than a quarter since the last period
    (tiers smaller than the adapter set level off above the floor; tiers that hold every adapter
    fall to it)."""
    if now is None or now <= floor:
        return False
    return before is None or now < drop * before


def line_for(n: int, row: dict) -> str:
    sat, l80 = row["saturation"], row["load_80"]
    tiers = l80.get("ttft_ms_by_tier") or {}
    by_tier = "  ".join(f"{t} p99 {s['p99']} ({s['count']})" for t, s in tiers.items())
    activity = l80.get("adapter_activity") or {}
    fetch_ms = (activity.get("mean_load_ms") or {}).get("cpu")
    origins = activity.get("store_fetch_origins") or {}
    fetches = f"  fetch {fetch_ms} ms mean, store {origins}" if fetch_ms is not None else ""
    if "engine" in sat:
        fetches += f"  engine empty {sat['engine']['empty_share']:.0%} at saturation"
    gen = sat.get("generator")
    if gen:
        flag = " SATURATED" if gen["saturated"] else ""
        fetches += f"  generator busy {gen['busy_share']:.0%}, late p99 {gen['lag_ms']['p99']} ms{flag}"
    cpu = sat.get("cpu") or {}
    if cpu.get("worker") is not None:
        others = "  ".join(
            f"{k} {v}" for k, v in cpu.items() if k not in ("worker", "worker_busiest_threads") and any(v)
        )
        fetches += (
            f"  cpu at saturation: worker {cpu['worker']} (threads {cpu.get('worker_busiest_threads')})"
            + (f" {others}" if others else "")
        )
    if activity.get("gc_collections"):
        fetches += f"  gc at 80% {activity['gc_collections']} ({activity['gc_over_10ms']} over 10 ms)"
    sat_activity = sat.get("adapter_activity") or {}
    step = sat_activity.get("step_ms")
    steps = f" {step} ms a step" if step is not None else ""
    if sat_activity.get("mean_sequences_per_step") is not None:
        steps += f" ({sat_activity['mean_sequences_per_step']} sequences"
        if sat_activity.get("mean_adapters_per_step") is not None:
            steps += f" of {sat_activity['mean_adapters_per_step']} adapters"
        admissions = sat_activity.get("step_admissions") or {}
        total = sum(admissions.values())
        if total:
            steps += ", admission ended by " + ", ".join(
                f"{k} {v / total:.0%}" for k, v in sorted(admissions.items(), key=lambda kv: -kv[1])
            )
        steps += ")"
    if sat.get("outside_engine_ms"):
        steps += (
            f", outside the engine {sat['outside_engine_ms']['mean']} ms a request"
            f" ({sat['mean_requests_outside_engine']} requests on average)"
        )
    return (
        f"N={n:5d}  saturation {sat['request_throughput']:.2f} req/s {sat['output_token_throughput']:.0f} tok/s{steps}"
        f"  @80% TTFT p50 {l80['ttft_ms']['p50']} p99 {l80['ttft_ms']['p99']} ms  by tier: {by_tier}{fetches}"
    )


def resident_share(summary: dict) -> float | None:
    """Requests whose adapter was in the GPU or CPU tier on arrival, over requests with an adapter."""
    by_tier = summary.get("ttft_ms_by_tier") or {}
    counts = {t: s["count"] for t, s in by_tier.items()}
    total = sum(counts.values())
    return round((counts.get("gpu", 0) + counts.get("cpu", 0)) / total, 4) if total else None


def coverage(held: dict[str, dict[str, str]], ids: Sequence[str], exponent: float) -> dict[str, object]:
    """What the fleet's holdings could serve: the Zipf share of requests whose adapter some worker
    holds (the resident share a router that always found the holder would reach), how many
    distinct adapters that is, how many are held twice, and how many of the most popular `held`
    ids (the best a fleet of that many distinct adapters could hold) are among them; per worker,
    how many it holds in a GPU slot and in the CPU tier only; the popularity ranks (0 = the most
    popular) of the adapters held twice."""
    weights = zipf_weights(len(ids), exponent)
    union = set().union(*held.values())
    rank = {aid: i for i, aid in enumerate(ids)}
    twice = sorted(rank.get(aid, -1) for aid in union if sum(aid in h for h in held.values()) > 1)
    share = sum(w for aid, w in zip(ids, weights, strict=True) if aid in union) / sum(weights)
    return {
        "share": round(share, 4),
        "distinct": len(union),
        "held_twice": len(twice),
        "of_the_top": sum(1 for aid in ids[: len(union)] if aid in union),
        "by_worker": {
            a: {t: sum(1 for v in h.values() if v == t) for t in ("gpu", "cpu")} for a, h in held.items()
        },
        "ranks_held_twice": twice,
    }
