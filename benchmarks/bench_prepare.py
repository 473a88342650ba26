"""Device time of one `LoRABatch.prepare` (the one-launch Triton kernel that sorts a step's rows by
slot and builds the work lists) against the worker's slot count and the step's rows.

Each row of the table replays a CUDA graph of 20 prepares 20 times, timed with events, so launch
costs are left out. The rows' slots are drawn at random from `distinct` slots spread over
[0, max_loras), with a share of base-model rows, as a serving step's are.

    python benchmarks/bench_prepare.py [--loras 64,256,1024] [--json out.json]

To compare another checkout's kernel, run this file with that checkout's `loraserve` first on the
path (benchmarks/serving_fleet.py's tree_shim builds such a folder)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

try:
    import loraserve  # noqa: F401  (whichever checkout is first on the path)
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loraserve.kernels import LoRABatch

# (rows, distinct slots): one decode row, a decode batch of 64, a mixed step, a long prefill
STEPS = ((1, 1), (64, 40), (512, 48), (4096, 8))
GRAPH_PREPARES, REPLAYS = 20, 20


def step_slots(rows: int, distinct: int, max_loras: int, gen: torch.Generator) -> torch.Tensor:
    chosen = torch.randperm(max_loras, generator=gen)[: min(distinct, max_loras)].to(torch.int32)
    slots = chosen[torch.randint(0, chosen.numel(), (rows,), generator=gen)]
    slots[torch.rand(rows, generator=gen) < 0.05] = -1  # a few base-model rows
    return slots.cuda()


def prepare_us(max_loras: int, rows: int, distinct: int) -> float:
    gen = torch.Generator().manual_seed(rows * 7919 + max_loras)
    slots = step_slots(rows, distinct, max_loras, gen)
    batch = LoRABatch.allocate(max(rows, 4096), max_loras, "cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # compile and warm outside the capture
        for _ in range(3):
            batch.prepare(slots)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_PREPARES):
            batch.prepare(slots)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (REPLAYS * GRAPH_PREPARES)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loras", default="64,256,1024", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--label", default="", help="a name for this run's rows")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    results = [
        {"label": a.label, "max_loras": lo, "rows": t, "distinct": d, "us": round(prepare_us(lo, t, d), 2)}
        for lo in a.loras
        for t, d in STEPS
    ]
    print(f"{'label':10} {'max_loras':>9} {'rows':>6} {'distinct':>8} {'us':>9}")
    for r in results:
        print(f"{r['label']:10} {r['max_loras']:>9} {r['rows']:>6} {r['distinct']:>8} {r['us']:>9.2f}")
    if a.json:
        a.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": results}, indent=1))


if __name__ == "__main__":
    main()
