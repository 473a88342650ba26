"""Plot bench_serving.py's JSON: throughput at saturation and p99 TTFT (at 50% / 80% of it) against
the number of adapters N, and the p50 / p99 TTFT at 80% load by the tier each request's adapter
was in when it arrived. The saturation throughputs of further runs' JSON files are drawn as hollow
markers. Needs matplotlib (the `plots` extra).

    python benchmarks/plot_serving.py serving.json serving.png [other-run.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TIERS = ("gpu", "cpu", "store")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(argv[0]).read_text())
    rows = sorted(data["n"].items(), key=lambda kv: int(kv[0]))
    ns = [int(n) for n, _ in rows]
    fig, (ax1, ax3) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.plot(ns, [r["saturation"]["request_throughput"] for _, r in rows], "o-", color="tab:blue")
    for k, other in enumerate(argv[2:]):
        other_run = json.loads(Path(other).read_text())
        more = other_run["n"]
        order = ", ".join(f"N={n}" for n in more)
        xs = [int(n) for n in more]
        ys = [r["saturation"]["request_throughput"] for r in more.values()]
        ax1.plot(
            xs,
            ys,
            "o",
            mfc="none",
            ms=9,
            color="tab:blue",
            label=f"{other_run.get('date') or f'run {k + 2}'} (order {order})",
        )
    if argv[2:]:
        ax1.legend(loc="lower right")
    ax1.set_xscale("log")
    ax1.set_xlabel("adapters N (Zipf 1.0)")
    ax1.set_ylabel("throughput at saturation (req/s)", color="tab:blue")
    ax1.set_ylim(bottom=0)
    ax2 = ax1.twinx()
    for load, style in (("load_50", "s--"), ("load_80", "^--")):
        ax2.plot(
            ns,
            [r[load]["ttft_ms"]["p99"] for _, r in rows],
            style,
            color="tab:red",
            label=f"p99 TTFT @{load[5:]}%",
        )
    ax2.set_ylabel("p99 TTFT (ms)", color="tab:red")
    ax2.set_ylim(bottom=0)
    ax2.legend(loc="upper right")
    ax1.set_title("throughput and p99 TTFT vs N")
    width = 0.8 / len(TIERS)
    for k, tier in enumerate(TIERS):
        xs, p50, p99 = [], [], []
        for i, (_, r) in enumerate(rows):
            t = (r["load_80"].get("ttft_ms_by_tier") or {}).get(tier)
            if t and t["count"]:
                xs.append(i + (k - 1) * width)
                p50.append(t["p50"])
                p99.append(t["p99"])
        ax3.bar(xs, p99, width, label=f"{tier} p99", alpha=0.45)
        ax3.scatter(xs, p50, marker="_", s=200, color="black")
    ax3.set_xticks(range(len(rows)), [f"N={n}" for n in ns])
    ax3.set_ylabel("TTFT at 80% load (ms; bars p99, ticks p50)")
    ax3.set_title("TTFT by where the adapter was on arrival")
    ax3.legend()
    fig.suptitle(f"{data.get('device', '')}, {data.get('date', '')}")
    fig.tight_layout()
    fig.savefig(argv[1], dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
