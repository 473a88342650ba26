"""The one-row norm + projection kernels (inference_worker/model/skinny_norm.py, skinny_norm_rope.py)
against what they replace, on the q|k|v and gate | up projections of Llama-3.2-1B and Llama-3-8B,
bf16, one CUDA GPU.

For each projection a chain of layers with their own weight copies (enough that the chain's weights
overflow twice the L2 cache) is captured in one CUDA graph per variant, and the graphs are replayed
in interleaved rounds (CUDA events; median µs per layer):

- apart: the model's steps as they run without the fusion: fused_ops.rms_norm (with a residual),
  then the projection the model takes for one row (the skinny GEMM up to linear.SKINNY_MAX_OUT
  outputs, cuBLAS above), then fused_ops.rope_and_cache for q|k|v, fused_ops.silu_mul for gate | up;
- fused: what the model runs instead (norm_qkv_rope for q|k|v, norm_linear's gate | up pair) with
  its default configuration and each swept one (block_n x block_k x warps).

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

from benchmarks.bench_skinny_gemm import DEFAULT_L2
from benchmarks.graph_timing import capture, time_graphs
from loraserve.inference_worker.model.fused_ops import rms_norm, rope_and_cache, silu_mul
from loraserve.inference_worker.model.linear import SKINNY_MAX_OUT
from loraserve.inference_worker.model.skinny_gemm import SkinnyConfig, skinny_linear
from loraserve.inference_worker.model.skinny_norm import default_config, norm_linear
from loraserve.inference_worker.model.skinny_norm_rope import norm_qkv_rope

# (N, K, heads) of the fused projections: q|k|v with its (query heads, KV heads, head_dim) for RoPE,
# gate | up with None
SHAPES: dict[str, dict[str, tuple[int, int, tuple[int, int, int] | None]]] = {
    "1b": {"qkv": (3072, 2048, (32, 8, 64)), "gate_up": (16384, 2048, None)},
    "8b": {"qkv": (6144, 4096, (32, 8, 128)), "gate_up": (28672, 4096, None)},
}
DTYPE = torch.bfloat16
EPS = 1e-5


def name(c: SkinnyConfig) -> str:
    return f"n{c.block_n}.k{c.block_k}.w{c.num_warps}.st{c.num_stages}"


class Chain:
    def __init__(
        self, n: int, k: int, heads: tuple[int, int, int] | None, layers: int, dev: torch.device
    ) -> None:
        g = torch.Generator(device=dev).manual_seed(n + k)
        self.n, self.k, self.heads = n, k, heads
        self.weights = [
            (torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(DTYPE) for _ in range(layers)
        ]
        self.norm_w = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(DTYPE)
        self.x = torch.randn(1, k, device=dev, generator=g).to(DTYPE)
        self.res = torch.randn(1, k, device=dev, generator=g).to(DTYPE)
        if heads is not None:  # RoPE's inputs: a position's cos | sin, a cache slot, the caches
            _, nkv, d = heads
            self.cos_sin = torch.randn(1, d, device=dev, generator=g)
            self.slot = torch.tensor([3], device=dev)
            self.caches = [torch.zeros(2, 16, nkv, d, dtype=DTYPE, device=dev) for _ in range(2)]
        self.want = self.apart_one(self.weights[0]).float()

    def apart_one(self, w: torch.Tensor) -> torch.Tensor:
        h, _ = rms_norm(self.x, self.norm_w, EPS, self.res)
        y = skinny_linear(h, w) if self.n <= SKINNY_MAX_OUT else F.linear(h, w)
        if self.heads is None:
            return silu_mul(y)
        return rope_and_cache(y, self.cos_sin, self.slot, *self.caches, *self.heads)[0]

    def fused_one(self, w: torch.Tensor, c: SkinnyConfig | None) -> torch.Tensor:
        if self.heads is None:
            return norm_linear(self.x, self.res, self.norm_w, EPS, w, pair=True, config=c)[0]
        rope = (self.cos_sin, self.slot, *self.caches, *self.heads)
        return norm_qkv_rope(self.x, self.res, self.norm_w, EPS, w, None, *rope, config=c)[0]

    def apart(self) -> None:
        for w in self.weights:
            self.apart_one(w)

    def fused(self, c: SkinnyConfig | None) -> Callable[[], None]:
        def run() -> None:
            for w in self.weights:
                self.fused_one(w, c)

        return run

    def check(self, c: SkinnyConfig | None) -> str | None:
        try:
            y = self.fused_one(self.weights[0], c).float()
            torch.cuda.synchronize()
        except Exception as e:  # a configuration the compiler or the device rejects
            return f"{type(e).__name__}: {str(e)[:300]}"
        err = ((y - self.want).abs().max() / self.want.abs().max().clamp_min(1e-6)).item()
        return None if err <= 2e-2 else f"relative error {err:.3g}"


def configs(heads: tuple[int, int, int] | None) -> list[SkinnyConfig]:
    """The sweep: block_n x block_k x warps, at most 128 fp32 accumulator elements a thread; with
    RoPE block_n divides head_dim / 2 (a program's rotation pairs are of one head)."""
    out = []
    for bn, bk, warps in itertools.product((8, 16, 32, 64), (256, 512), (2, 4, 8)):
        if bn * bk * 2 // (32 * warps) > 128 or (heads is not None and (heads[2] // 2) % bn):
            continue
        out.append(SkinnyConfig(bn, bk, 1, num_warps=warps, num_stages=3, use_dot=False))
    return out


def run(model: str, proj: str, rounds: int, dev: torch.device) -> dict:
    n, k, heads = SHAPES[model][proj]
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", DEFAULT_L2) or DEFAULT_L2
    layers = max(8, -(-2 * l2 // (n * k * 2)))
    chain = Chain(n, k, heads, layers, dev)
    graphs = {"apart": capture(chain.apart)}
    skipped = {}
    for key, c in [("fused default", None), *((name(c), c) for c in configs(heads))]:
        why = chain.check(c)
        if why is None:
            graphs[key] = capture(chain.fused(c))
        else:
            skipped[key] = why
    us = time_graphs(graphs, rounds, 10, layers)
    fused = [key for key in us if key != "apart"]
    return {
        "model": model,
        "proj": proj,
        "n": n,
        "k": k,
        "layers": layers,
        "default": name(default_config(n, k, heads is None)),
        "us": us,
        "best": min(fused, key=us.__getitem__) if fused else None,
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
        us, a = r["us"], r["us"]["apart"]
        d, b = us.get("fused default"), us.get(r["best"])
        cells = [f"{v:.2f}" if v is not None else "failed" for v in (d, b)]
        ratios = [f"{v / a:.3f}" if v is not None else "-" for v in (d, b)]
        print(
            f"| {r['model']} {r['proj']} {r['n']}x{r['k']} | {a:.2f} | {cells[0]} ({r['default']}) | "
            f"{cells[1]} ({r['best']}) | {ratios[0]} | {ratios[1]} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"device": torch.cuda.get_device_name(dev), "results": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
