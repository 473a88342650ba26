"""The one-row norm + projection kernel (inference_worker/model/skinny_norm.py) against what it
replaces, on the q|k|v and gate | up projections of Llama-3.2-1B and Llama-3-8B, bf16, one CUDA GPU.

For each projection a chain of layers with their own weight copies (enough that the chain's weights
overflow twice the L2 cache) is captured in one CUDA graph per variant, and the graphs are replayed
in interleaved rounds (CUDA events; median µs per layer):

- apart: the model's steps as they run without the fusion: fused_ops.rms_norm (with a residual),
  then the projection the model takes for one row (the skinny GEMM up to linear.SKINNY_MAX_OUT
  outputs, cuBLAS above), then fused_ops.silu_mul for gate | up;
- fused: norm_linear with its default configuration and each swept one (block_n x block_k x warps).

Each variant's output is checked against the apart chain's before it is timed. The kernels launch
with programmatic dependent launch where the GPU supports it, as in the model.

    python benchmarks/bench_skinny_norm.py [--models 1b,8b] [--rounds 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_skinny_gemm import DEFAULT_L2, capture, time_graphs
from loraserve.inference_worker.model.fused_ops import rms_norm, silu_mul
from loraserve.inference_worker.model.linear import SKINNY_MAX_OUT
from loraserve.inference_worker.model.skinny_gemm import SkinnyConfig, skinny_linear
from loraserve.inference_worker.model.skinny_norm import default_config, norm_linear

# (N, K, pair) of the fused projections
SHAPES = {
    "1b": {"qkv": (3072, 2048, False), "gate_up": (16384, 2048, True)},
    "8b": {"qkv": (6144, 4096, False), "gate_up": (28672, 4096, True)},
}
DTYPE = torch.bfloat16
EPS = 1e-5


def name(c: SkinnyConfig) -> str:
    return f"n{c.block_n}.k{c.block_k}.w{c.num_warps}.st{c.num_stages}"


class Chain:
    def __init__(self, n: int, k: int, pair: bool, layers: int, dev: torch.device) -> None:
        g = torch.Generator(device=dev).manual_seed(n + k)
        self.n, self.k, self.pair = n, k, pair
        self.weights = [
            (torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(DTYPE) for _ in range(layers)
        ]
        self.norm_w = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(DTYPE)
        self.x = torch.randn(1, k, device=dev, generator=g).to(DTYPE)
        self.res = torch.randn(1, k, device=dev, generator=g).to(DTYPE)

    def apart_one(self, w: torch.Tensor) -> torch.Tensor:
        h, _ = rms_norm(self.x, self.norm_w, EPS, self.res)
        y = skinny_linear(h, w) if self.n <= SKINNY_MAX_OUT else F.linear(h, w)
        return silu_mul(y) if self.pair else y

    def apart(self) -> None:
        for w in self.weights:
            self.apart_one(w)

    def fused(self, c: SkinnyConfig | None) -> Callable[[], None]:
        def run() -> None:
            for w in self.weights:
                norm_linear(self.x, self.res, self.norm_w, EPS, w, pair=self.pair, config=c)

        return run

    def check(self, c: SkinnyConfig | None) -> str | None:
        want = self.apart_one(self.weights[0]).float()
        try:
            y = norm_linear(self.x, self.res, self.norm_w, EPS, self.weights[0], pair=self.pair, config=c)[0]
            torch.cuda.synchronize()
        except Exception as e:  # a configuration the compiler or the device rejects
            return f"{type(e).__name__}: {str(e)[:300]}"
        err = ((y.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
        return None if err <= 2e-2 else f"relative error {err:.3g}"


def configs(pair: bool) -> list[SkinnyConfig]:
    out = []
    for bn, bk, warps in itertools.product((8, 16, 32, 64), (256, 512), (2, 4, 8)):
        if bn * bk * (2 if pair else 1) // (32 * warps) > 128:  # fp32 accumulator elements a thread
            continue
        out.append(SkinnyConfig(bn, bk, 1, num_warps=warps, num_stages=3, use_dot=False))
    return out


def run(model: str, proj: str, rounds: int, dev: torch.device) -> dict:
    n, k, pair = SHAPES[model][proj]
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", DEFAULT_L2) or DEFAULT_L2
    layers = max(8, -(-2 * l2 // (n * k * 2)))
    chain = Chain(n, k, pair, layers, dev)
    graphs = {"apart": capture(chain.apart), "fused default": capture(chain.fused(None))}
    skipped = {}
    for c in configs(pair):
        why = chain.check(c)
        if why is None:
            graphs[name(c)] = capture(chain.fused(c))
        else:
            skipped[name(c)] = why
    us = time_graphs(graphs, rounds, 10, layers)
    best = min((key for key in us if key not in ("apart", "fused default")), key=us.__getitem__)
    return {
        "model": model,
        "proj": proj,
        "n": n,
        "k": k,
        "layers": layers,
        "default": name(default_config(n, k, pair)),
        "us": us,
        "best": best,
        "skipped": skipped,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="1b,8b")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_skinny_norm needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    results = [run(m, p, args.rounds, dev) for m in args.models.split(",") for p in SHAPES[m]]
    print(f"{torch.cuda.get_device_name(dev)}: µs per layer, median of {args.rounds} rounds")
    print("| shape | apart | fused, default | fused, best (config) | default / apart | best / apart |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        us = r["us"]
        a, d, b = us["apart"], us["fused default"], us[r["best"]]
        print(
            f"| {r['model']} {r['proj']} {r['n']}x{r['k']} | {a:.2f} | {d:.2f} ({r['default']}) | "
            f"{b:.2f} ({r['best']}) | {d / a:.3f} | {b / a:.3f} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"device": torch.cuda.get_device_name(dev), "results": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
