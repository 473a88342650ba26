"""The gate | up projection of Llama-3-8B with LoRA, two ways, on one CUDA GPU: the base GEMM, then
add_lora and the model's silu_mul kernel (two kernels after the shrink, y read and written in
between), against the base GEMM then add_lora_silu_mul (one expand that writes the activation).
Also the base GEMM and silu_mul alone, the floor the LoRA work is added to.

Each step runs LAYERS layers, each with its own weights and adapter slots (so weights stream from
HBM), captured in a CUDA graph; the variants are replayed in interleaved rounds and the median
per layer reported. Launch options are the worker's (PDL on both LoRA kernels where supported).

    python benchmarks/bench_fused_silu.py [--tokens 64,512,2048] [--adapters 1,32] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.graph_timing import capture, round_times
from loraserve.inference_worker.lora.layer import worker_launch_options
from loraserve.inference_worker.model.fused_ops import silu_mul
from loraserve.kernels import LaunchOptions, LoRABatch, add_lora, add_lora_silu_mul

HIDDEN, INTER, RANK, LAYERS = 4096, 14336, 16, 8
DTYPE = torch.bfloat16


@dataclasses.dataclass
class Layers:
    """LAYERS gate | up projections, each with its own weights and adapter slots."""

    weights: list[torch.Tensor]
    lora_a: list[torch.Tensor]
    lora_b: list[torch.Tensor]
    ranks: torch.Tensor
    batch: LoRABatch
    options: LaunchOptions

    def base(self, x: torch.Tensor) -> None:
        for w in self.weights:
            silu_mul(F.linear(x, w))

    def unfused(self, x: torch.Tensor) -> None:
        for w, a, b in zip(self.weights, self.lora_a, self.lora_b, strict=True):
            y = F.linear(x, w)
            add_lora(y, x, a, b, self.ranks, self.batch, [0, INTER, 2 * INTER], options=self.options)
            silu_mul(y)

    def fused(self, x: torch.Tensor) -> None:
        for w, a, b in zip(self.weights, self.lora_a, self.lora_b, strict=True):
            y = F.linear(x, w)
            out = torch.empty(x.shape[0], INTER, dtype=DTYPE, device=x.device)
            add_lora_silu_mul(y, x, a, b, self.ranks, self.batch, out, options=self.options)


def time_graphs(variants: dict, rounds: int, replays: int) -> dict[str, list[float]]:
    """Each variant captured in a CUDA graph and replayed in interleaved rounds: us per layer."""
    return round_times({name: capture(fn) for name, fn in variants.items()}, rounds, replays, LAYERS)


def with_tiles(fn, block_n: int, num_warps: int):  # type: ignore[no-untyped-def]
    """fn run with add_lora_silu_mul's expand plan set to these tiles (the sweep)."""
    from loraserve.kernels import triton_ops

    planned = triton_ops.plan_expand_pair

    def plan(*a, **k):  # type: ignore[no-untyped-def]
        return dataclasses.replace(planned(*a, **k), block_n=block_n, num_warps=num_warps)

    def run(x: torch.Tensor) -> None:
        triton_ops.plan_expand_pair = plan
        try:
            fn(x)
        finally:
            triton_ops.plan_expand_pair = planned

    return run


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="64,512,2048,4096")
    ap.add_argument("--adapters", default="1,32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--json", default="")
    ap.add_argument(
        "--tiles",
        default="",
        help="also time add_lora_silu_mul with these expand tiles, 'block_n:num_warps,...' (a sweep)",
    )
    args = ap.parse_args()
    tiles = [tuple(int(v) for v in t.split(":")) for t in args.tiles.split(",") if t]
    if not torch.cuda.is_available():
        print("bench_fused_silu.py times CUDA graphs: it needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    max_adapters = max(int(a) for a in args.adapters.split(","))
    weights = [
        (torch.randn(2 * INTER, HIDDEN, device=dev, generator=g) * HIDDEN**-0.5).to(DTYPE)
        for _ in range(LAYERS)
    ]
    lora_a = [
        (torch.randn(max_adapters, 2, RANK, HIDDEN, device=dev, generator=g) * HIDDEN**-0.5).to(DTYPE)
        for _ in range(LAYERS)
    ]
    lora_b = [
        (torch.randn(max_adapters, 2 * INTER, RANK, device=dev, generator=g) * 0.01).to(DTYPE)
        for _ in range(LAYERS)
    ]
    ranks = torch.full((max_adapters,), RANK, dtype=torch.int32, device=dev)
    options = worker_launch_options(dev)
    rows: list[dict] = []
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(num_tokens, HIDDEN, device=dev, generator=g).to(DTYPE)
        for num_adapters in (int(a) for a in args.adapters.split(",")):
            batch = LoRABatch.allocate(num_tokens, max_adapters, dev, max_slices=2, max_rank=RANK)
            batch.prepare(torch.arange(num_tokens, device=dev, dtype=torch.int32) % num_adapters)
            layers = Layers(weights, lora_a, lora_b, ranks, batch, options)
            variants = {
                "base": layers.base,
                "add_lora + silu_mul": layers.unfused,
                "add_lora_silu_mul": layers.fused,
            }
            for block_n, num_warps in tiles:
                variants[f"fused {block_n}:{num_warps}"] = with_tiles(layers.fused, block_n, num_warps)
            times = time_graphs({n: partial(fn, x) for n, fn in variants.items()}, args.rounds, args.replays)
            row = {"tokens": num_tokens, "adapters": num_adapters}
            row.update({name: statistics.median(t) for name, t in times.items()})
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "options": dataclasses.asdict(options),
        "unit": "us per layer (gate|up GEMM + LoRA + activation), median of interleaved rounds",
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"\n{result['gpu']}: {result['unit']}")
    if tiles:
        for r in rows:
            print(r)
    print("| T | adapters | base | add_lora + silu_mul | add_lora_silu_mul | LoRA cost: two / one kernel |")
    print("|---:|---:|---:|---:|---:|---|")
    for r in rows:
        two, one = r["add_lora + silu_mul"] - r["base"], r["add_lora_silu_mul"] - r["base"]
        print(
            f"| {r['tokens']} | {r['adapters']} | {r['base']:.1f} | {r['add_lora + silu_mul']:.1f} | "
            f"{r['add_lora_silu_mul']:.1f} | {two:.1f} / {one:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
