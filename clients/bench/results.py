"""What a run measured: one `RequestRecord` per request, and the summary over them (throughput,
TTFT / time per output token / end-to-end latency percentiles, SLO attainment, errors by status,
TTFT by the tier the adapter was found in, the workers' adapter activity), as JSON and as a table.

TTFT is from sending the request to its first output token; TPOT is (end - first token) divided by
the tokens after the first (vLLM's definition); both measured by the client. A stream interval
keeps them: its first token comes alone and at once, its last one in its last message. A worker
that merges what queued while it was busy may join the first token with the next ones, and then
TTFT is late and TPOT a little short, as for any client of that worker; no per-message gap is
reported as a per-token one."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from loraserve.clients.bench.worker_metrics import AdapterActivity
from loraserve.clients.tables import format_table

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)  # (one object a request, kept for the whole run)
class RequestRecord:
    index: int
    adapter_id: str
    scheduled_s: float  # planned send time, from the start of the run
    sent_s: float  # actual send time (later than planned when the generator falls behind)
    end_s: float = 0.0
    first_token_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    messages: int = 0  # stream messages (chunks) received
    status: str = "OK"  # or the failure's status: a gRPC code name, "HTTP 503", ...
    error: str = ""
    worker: str = ""
    adapter_tier: str = ""  # gpu, cpu or store when the worker says; "" otherwise
    engine_s: float | None = None  # the worker's engine's own time for it, when the worker says

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.output_tokens - 1)


def percentiles(values: Sequence[float], ps: Sequence[int] = PERCENTILES) -> dict[str, float | None]:
    """pXX of values (linear interpolation between order statistics); None with no values."""
    if not values:
        return {f"p{p}": None for p in ps}
    if len(values) == 1:
        return {f"p{p}": float(values[0]) for p in ps}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {f"p{p}": cuts[p - 1] for p in ps}


def _ms(stats: dict[str, float | None], mean: float | None) -> dict[str, float | None]:
    out = {k: None if v is None else round(v * 1e3, 3) for k, v in stats.items()}
    out["mean"] = None if mean is None else round(mean * 1e3, 3)
    return out


def latency_ms(values: list[float]) -> dict[str, float | None]:
    """Seconds as p50 / p90 / p99 / mean in ms."""
    return _ms(percentiles(values), statistics.fmean(values) if values else None)


def summarize(
    records: Sequence[RequestRecord],
    *,
    duration_s: float,
    slo_ttft_ms: float | None = None,
    activity: AdapterActivity | None = None,
    generator: dict[str, object] | None = None,
) -> dict[str, object]:
    """The run's summary; duration_s is from the first send to the last completion; `generator`
    is the load generator's own load (runner.GeneratorLoad.as_dict)."""
    ok = [r for r in records if r.ok]
    ttfts = [t for r in ok if (t := r.ttft_s) is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    span = max(duration_s, 1e-9)
    summary: dict[str, object] = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": round(duration_s, 3),
        "request_throughput": round(len(ok) / span, 3),
        "output_token_throughput": round(out_tokens / span, 3),
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "messages_per_request": round(statistics.fmean([r.messages for r in ok]), 2) if ok else None,
        "ttft_ms": latency_ms(ttfts),
        "tpot_ms": latency_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_ms": latency_ms([r.e2e_s for r in ok]),
        "send_lag_ms": latency_ms([r.sent_s - r.scheduled_s for r in records]),
        "errors": dict(sorted(Counter(r.status for r in records if not r.ok).items())),
        "base_requests": sum(1 for r in records if not r.adapter_id),
        "distinct_adapters": len({r.adapter_id for r in records if r.adapter_id}),
    }
    if slo_ttft_ms is not None:
        # every request counts: a failed one missed its target
        met = sum(1 for t in ttfts if t * 1e3 <= slo_ttft_ms)
        summary["slo"] = {
            "ttft_ms": slo_ttft_ms,
            "met": met,
            "attainment": round(met / len(records), 4) if records else None,
        }
    tiers = sorted({r.adapter_tier for r in ok if r.adapter_tier})
    if tiers:
        by_tier: dict[str, object] = {}
        for tier in tiers:
            v = [x for r in ok if r.adapter_tier == tier and (x := r.ttft_s) is not None]
            by_tier[tier] = {"count": len(v), **latency_ms(v)}
        summary["ttft_ms_by_tier"] = by_tier
    outside = [r.e2e_s - r.engine_s for r in ok if r.engine_s is not None]
    if outside:
        # the way in (client, worker front, to the engine) and out (the end back to the client): in
        # a closed loop, throughput x its mean requests are on their way and not at the engine
        summary["outside_engine_ms"] = latency_ms(outside)
        summary["mean_requests_outside_engine"] = round(len(outside) / span * statistics.fmean(outside), 2)
    workers = Counter(r.worker for r in ok if r.worker)
    if len(workers) > 1:
        summary["requests_by_worker"] = dict(sorted(workers.items()))
    if activity is not None:
        summary["adapter_activity"] = activity.as_dict()
    if generator is not None:
        summary["generator"] = generator
    return summary


def records_as_dicts(records: Sequence[RequestRecord]) -> list[dict[str, object]]:
    return [asdict(r) for r in records]


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def format_summary(summary: dict[str, object]) -> str:
    """The summary as the terminal table printed at the end of a run."""
    lines = [
        format_table(
            ("run", ""),
            [
                ("requests (completed / failed)", f"{summary['completed']} / {summary['failed']}"),
                ("duration (s)", _fmt(summary["duration_s"])),
                ("request throughput (req/s)", _fmt(summary["request_throughput"])),
                ("output token throughput (tok/s)", _fmt(summary["output_token_throughput"])),
                ("stream messages per request", _fmt(summary["messages_per_request"])),
                ("base-model requests", _fmt(summary["base_requests"])),
                ("distinct adapters", _fmt(summary["distinct_adapters"])),
            ],
        ),
        "",
    ]
    rows = []
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("end-to-end", "e2e_ms")):
        s = summary[key]
        assert isinstance(s, dict)
        rows.append((name, *(_fmt(s[k]) for k in ("mean", "p50", "p90", "p99"))))
    by_tier = summary.get("ttft_ms_by_tier")
    if isinstance(by_tier, dict):
        for tier, s in by_tier.items():
            rows.append(
                (
                    f"TTFT, adapter in {tier} ({s['count']})",
                    *(_fmt(s[k]) for k in ("mean", "p50", "p90", "p99")),
                )
            )
    lines += [format_table(("latency (ms)", "mean", "p50", "p90", "p99"), rows), ""]
    slo = summary.get("slo")
    if isinstance(slo, dict):
        lines.append(f"TTFT SLO {slo['ttft_ms']} ms: {slo['met']} met, attainment {_fmt(slo['attainment'])}")
    errors = summary["errors"]
    assert isinstance(errors, dict)
    lines.append("errors: " + (", ".join(f"{k} {v}" for k, v in errors.items()) if errors else "none"))
    gen = summary.get("generator")
    if isinstance(gen, dict):
        lag = gen["lag_ms"]
        assert isinstance(lag, dict)
        procs = gen.get("processes", 1)
        whose = "its event loop" if procs == 1 else f"the busiest of its {procs} processes' event loops"
        line = (
            f"load generator: {whose} busy {gen['busy_share']:.0%} of the run, "
            f"a timer late by p50 {_fmt(lag['p50'])} / p99 {_fmt(lag['p99'])} ms"
        )
        if gen["saturated"]:
            line += (
                "\nwarning: the load generator was saturated: requests were sent and read late, "
                "so the throughput is a lower bound and the latencies include the generator's "
                "own delay (lower the rate or concurrency, or use more --processes)"
            )
        lines.append(line)
    act = summary.get("adapter_activity")
    if isinstance(act, dict):
        lines.append(
            "adapter loads: "
            + ", ".join(f"{tier} {n}" for tier, n in act["loads"].items())
            + f"; evictions: {', '.join(f'{t} {n}' for t, n in act['evictions'].items()) or 'none'}"
            + f"; store fetches: {act['store_fetches']}"
        )
        lk = act["lookups"]
        if lk:
            lines.append("admission lookups: " + ", ".join(f"{k} {v}" for k, v in lk.items()))
        if act.get("steps"):
            line = f"engine steps: {act['steps']}, {act['mean_sequences_per_step']} sequences per step"
            if act.get("mean_adapters_per_step") is not None:
                line += f" ({act['mean_adapters_per_step']} adapters)"
            if act.get("step_ms") is not None:
                line += f", {act['step_ms']} ms a step"
            if act.get("device_ms_per_step") is not None:
                line += f" (device {act['device_ms_per_step']} ms; waited for it {act['device_wait_ms_per_step']})"
            lines.append(line)
    return "\n".join(lines)
