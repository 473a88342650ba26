"""The skinny GEMM (inference_worker/model/skinny_gemm.py) against cuBLAS (F.linear) on the decode
projections of Llama-3.2-1B and Llama-3-8B, bf16, on one CUDA GPU, over a sweep of its configurations.

For each projection (N x K) and row count M, a chain of distinct weight copies (8, or more where 8
would not fill twice the L2 cache, so every GEMM reads its weights from HBM) is captured in one CUDA
graph per variant: cuBLAS, the default configuration, each swept configuration. The graphs are
replayed in interleaved rounds timed with CUDA events; the median per GEMM is reported with the
bandwidth it achieves (weight bytes / time). Each configuration's output is checked against F.linear
before it is timed; one that fails to compile or to match is skipped (and listed in the JSON).

The skinny kernels launch with programmatic dependent launch where the GPU supports it
(model/launch.py): in the chain each one starts while the GEMM before it ends and loads its first
weight tile before it waits. The best configuration is also timed without PDL in the same rounds;
--no-pdl runs the whole sweep without it (launch.set_pdl(False)). --norm puts the model's RMSNorm
kernel before each GEMM of both chains (x made by a small kernel, as in a layer).

The sweep runs in two stages to stay within a few minutes: (1) block_n x block_k x split_k x use_dot
at 4 warps, (2) the best --top of those at 2 and 8 warps. --full sweeps the whole product (block_k 64
too, every warp count) at once; --quick a smaller first stage and no second. Configurations that
cannot work are pruned: tl.dot below 16 weight rows, the per-row path above 4 rows, tiles of more
than 128 or fewer than 8 weight elements a thread, a K part shorter than a K tile, splitting K where
the N tiles alone fill the GPU, grids of under half a program per SM. --list prints the sweep of
each case and exits (no GPU needed).

    python benchmarks/bench_skinny_gemm.py [--models 1b,8b] [--proj qkv,o,gate_up,down,lm_head]
        [--m 1,4,16] [--quick | --full] [--no-pdl] [--norm] [--json out.json] [--list]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.graph_timing import capture, time_graphs
from loraserve.inference_worker.model import arrival_counters, launch, skinny_gemm
from loraserve.inference_worker.model.fused_ops import rms_norm
from loraserve.inference_worker.model.skinny_gemm import SkinnyConfig, default_config, skinny_linear

# (N, K) of each projection, weights [N, K] as nn.Linear.weight
SHAPES = {
    "1b": {
        "qkv": (3072, 2048),
        "o": (2048, 2048),
        "gate_up": (16384, 2048),
        "down": (2048, 8192),
        "lm_head": (128256, 2048),
    },
    "8b": {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    },
}
DTYPE = torch.bfloat16
BLOCK_N, BLOCK_K, SPLIT_K, WARPS = (8, 16, 32, 64), (64, 128, 256, 512), (1, 2, 4, 8), (2, 4, 8)
MAX_ROWS_NO_DOT = 4  # the per-row path repeats its work for every row
DEFAULT_L2 = 50 * 2**20


def feasible(m: int, n: int, k: int, c: SkinnyConfig, num_sms: int) -> bool:
    """Whether configuration c can be worth timing for x [m, k] @ w [n, k].T (see the docstring)."""
    if not c.use_dot and m > MAX_ROWS_NO_DOT:
        return False
    per_thread = c.block_n * c.block_k // (32 * c.num_warps)
    if not 8 <= per_thread <= 128 or c.block_k > k // c.split_k:
        return False
    tiles = math.ceil(n / c.block_n)
    if c.split_k > 1 and (tiles >= 2 * num_sms or tiles * c.split_k > 8 * num_sms):
        return False
    return tiles * c.split_k >= num_sms // 2


def sweep(m: int, n: int, k: int, num_sms: int, mode: str) -> list[SkinnyConfig]:
    """The first-stage configurations of one case (all of them with mode 'full')."""
    block_n, block_k, warps = BLOCK_N, BLOCK_K[1:], (4,)
    if mode == "full":
        block_k, warps = BLOCK_K, WARPS
    elif mode == "quick":
        block_n, block_k = BLOCK_N[1:], BLOCK_K[2:]
    configs = []
    for bn, bk, split, nw, dot in itertools.product(block_n, block_k, SPLIT_K, warps, (True, False)):
        if dot and bn < 16:
            continue
        c = SkinnyConfig(bn, bk, split, num_warps=nw, num_stages=3, use_dot=dot)
        if feasible(m, n, k, c, num_sms):
            configs.append(c)
    return configs


def second_stage(best: list[SkinnyConfig], m: int, n: int, k: int, num_sms: int) -> list[SkinnyConfig]:
    """The best first-stage configurations at the other warp counts."""
    out = []
    for c in best:
        for nw in WARPS:
            v = dataclasses.replace(c, num_warps=nw)
            if v != c and v not in out and feasible(m, n, k, v, num_sms):
                out.append(v)
    return out


def name(c: SkinnyConfig) -> str:
    return f"n{c.block_n}.k{c.block_k}.s{c.split_k}.w{c.num_warps}.st{c.num_stages}.{'dot' if c.use_dot else 'sum'}"


class Case:
    """One projection's weight copies and input, and the chains run over them."""

    def __init__(self, n: int, k: int, m: int, weights: list[torch.Tensor], norm: bool) -> None:
        self.n, self.k, self.m, self.weights, self.norm = n, k, m, weights, norm
        dev = weights[0].device
        g = torch.Generator(device=dev).manual_seed(m)
        self.x = torch.randn(m, k, device=dev, generator=g).to(DTYPE)
        self.norm_w = torch.ones(k, device=dev, dtype=DTYPE)
        self.ref = F.linear(self.x, weights[0]).float()

    def _input(self) -> torch.Tensor:
        return rms_norm(self.x, self.norm_w, 1e-5)[0] if self.norm else self.x

    def cublas(self) -> None:
        for w in self.weights:
            F.linear(self._input(), w)

    def skinny(self, c: SkinnyConfig | None) -> Callable[[], None]:
        def run() -> None:
            for w in self.weights:
                skinny_linear(self._input(), w, config=c)

        return run

    def check(self, c: SkinnyConfig | None) -> str | None:
        """None where c compiles and matches F.linear, else why not."""
        try:
            y = skinny_linear(self.x, self.weights[0], config=c).float()
            torch.cuda.synchronize()
        except Exception as e:  # a configuration the compiler or the device rejects
            return f"{type(e).__name__}: {str(e)[:300]}"
        err = ((y - self.ref).abs().max() / self.ref.abs().max().clamp_min(1e-6)).item()
        if not err <= 1e-2:
            counters = arrival_counters._counters.get(self.x.device)
            if counters is not None:
                counters.zero_()
            return f"relative error {err:.3g}"
        return None

    def time(self, configs: list[SkinnyConfig], rounds: int, extra: dict | None = None) -> tuple[dict, dict]:
        """-> ({config name: us}, {config name: why skipped}); cuBLAS and `extra` graphs timed alongside."""
        graphs, skipped = {"cublas": capture(self.cublas)}, {}
        graphs.update(extra or {})
        for c in configs:
            why = self.check(c)
            if why is None:
                graphs[name(c)] = capture(self.skinny(c))
            else:
                skipped[name(c)] = why
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs["cublas"].replay()
        end.record()
        end.synchronize()
        replays = max(2, min(20, int(2000 / max(start.elapsed_time(end) * 1000, 1.0))))
        return time_graphs(graphs, rounds, replays, len(self.weights)), skipped


def run_case(case: Case, num_sms: int, args: argparse.Namespace) -> dict:
    m, n, k = case.m, case.n, case.k
    default = default_config(m, n, k, num_sms)
    configs = sweep(m, n, k, num_sms, args.mode)
    if default not in configs:
        configs.append(default)
    times, skipped = case.time(configs, args.rounds)
    if args.mode == "default":
        ranked = sorted((c for c in configs if name(c) in times), key=lambda c: times[name(c)])
        more = [c for c in second_stage(ranked[: args.top], m, n, k, num_sms) if c not in configs]
        t2, s2 = case.time(more, args.rounds)
        configs += more
        skipped.update(s2)
        scale = times["cublas"] / t2.pop("cublas")  # the second stage's rounds, on the first's clock
        times.update({key: v * scale for key, v in t2.items()})
    timed = [c for c in configs if name(c) in times]
    best = min(timed, key=lambda c: times[name(c)]) if timed else None
    no_pdl = None
    if best is not None and launch.pdl_launch(case.x.device):
        with launch.pdl_off():
            extra = {"best, no PDL": capture(case.skinny(best))}
        extra["best"] = capture(case.skinny(best))
        t3, _ = case.time([], args.rounds, extra)
        no_pdl = times[name(best)] * t3["best, no PDL"] / t3["best"]
    weight_bytes = n * k * DTYPE.itemsize

    def entry(c: SkinnyConfig | None, us: float | None) -> dict | None:
        if c is None or us is None:
            return None
        return {"config": dataclasses.asdict(c), "name": name(c), "us": us, "tb_s": weight_bytes / us / 1e6}

    return {
        "n": n,
        "k": k,
        "m": m,
        "copies": len(case.weights),
        "cublas": {"us": times["cublas"], "tb_s": weight_bytes / times["cublas"] / 1e6},
        "default": entry(default, times.get(name(default))),
        "best": entry(best, times[name(best)] if best else None),
        "best_no_pdl_us": no_pdl,
        "configs": {name(c): times[name(c)] for c in timed},
        "skipped": skipped,
    }


def line(r: dict) -> str:
    cub, best, dflt = r["cublas"], r["best"], r["default"]
    text = f"{r['model']:>2} {r['proj']:<7} N={r['n']:<6} K={r['k']:<5} M={r['m']:<2} | cuBLAS {cub['us']:7.2f} us {cub['tb_s']:4.2f} TB/s"
    if dflt:
        text += f" | default {dflt['us']:7.2f}"
    if best:
        text += f" | best {best['us']:7.2f} us {best['tb_s']:4.2f} TB/s x{cub['us'] / best['us']:.2f} {best['name']}"
    if r["best_no_pdl_us"]:
        text += f" | no PDL {r['best_no_pdl_us']:7.2f}"
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="1b,8b")
    ap.add_argument("--proj", default="qkv,o,gate_up,down,lm_head")
    ap.add_argument("--m", default="1,4,16", help="rows of x (at most 16)")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_const", dest="mode", const="quick")
    group.add_argument("--full", action="store_const", dest="mode", const="full")
    ap.set_defaults(mode="default")
    ap.add_argument("--top", type=int, default=2, help="first-stage configurations taken to the second")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--copies", type=int, default=8, help="weight copies per chain (at least)")
    ap.add_argument("--no-pdl", action="store_true", help="launch the skinny kernels without PDL")
    ap.add_argument("--norm", action="store_true", help="the model's RMSNorm before each GEMM")
    ap.add_argument("--json", default="")
    ap.add_argument("--list", action="store_true", help="print each case's sweep and exit")
    ap.add_argument("--sms", type=int, default=0, help="SM count for --list without a GPU (132)")
    args = ap.parse_args()
    models = [s for s in args.models.split(",") if s]
    projs = [s for s in args.proj.split(",") if s]
    rows = [int(s) for s in args.m.split(",") if s]
    bad = [s for s in models if s not in SHAPES] + [p for p in projs if p not in SHAPES["1b"]]
    if bad or not all(1 <= m <= skinny_gemm.MAX_ROWS for m in rows):
        ap.error(f"unknown models/projections {bad} or rows outside 1..{skinny_gemm.MAX_ROWS}: {rows}")
    cases = [(mo, p, m) for mo in models for p in projs for m in rows]
    if args.list:
        num_sms = args.sms or (
            torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
        )
        for mo, p, m in cases:
            n, k = SHAPES[mo][p]
            configs = sweep(m, n, k, num_sms, args.mode)
            print(
                f"{mo} {p} N={n} K={k} M={m}: {len(configs)} configs, default {name(default_config(m, n, k, num_sms))}"
            )
            print("   " + " ".join(name(c) for c in configs))
        return 0
    if not torch.cuda.is_available():
        print("bench_skinny_gemm.py times CUDA graphs: it needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.no_pdl:
        launch.set_pdl(False)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    num_sms, l2 = props.multi_processor_count, getattr(props, "L2_cache_size", 0) or DEFAULT_L2
    results: list[dict] = []
    began = time.monotonic()
    g = torch.Generator(device=dev).manual_seed(0)
    for mo in models:
        for p in projs:
            n, k = SHAPES[mo][p]
            copies = max(args.copies, math.ceil(2 * l2 / (n * k * DTYPE.itemsize)) + 1)
            w0 = (torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(DTYPE)
            weights = [w0] + [w0.clone() for _ in range(copies - 1)]
            for m in rows:
                r = {"model": mo, "proj": p, **run_case(Case(n, k, m, weights, args.norm), num_sms, args)}
                results.append(r)
                print(line(r), f"[{time.monotonic() - began:.0f} s]", flush=True)
            del weights, w0
            torch.cuda.empty_cache()
    result = {
        "gpu": torch.cuda.get_device_name(),
        "sms": num_sms,
        "l2_bytes": l2,
        "pdl": bool(launch.pdl_launch(dev)),
        "norm": args.norm,
        "mode": args.mode,
        "unit": "us per GEMM (median of interleaved rounds of CUDA-graph replays); tb_s: weight bytes / time",
        "seconds": time.monotonic() - began,
        "cases": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"\n{result['gpu']}, PDL {'on' if result['pdl'] else 'off'}: {result['unit']}")
    print(
        "| model | proj | N | K | M | cuBLAS us | TB/s | default us | best us | TB/s | cuBLAS / best | best config | best no PDL us |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in results:
        cub, best, dflt = r["cublas"], r["best"] or {}, r["default"] or {}
        ratio = cub["us"] / best["us"] if best else float("nan")
        print(
            f"| {r['model']} | {r['proj']} | {r['n']} | {r['k']} | {r['m']} | {cub['us']:.2f} | {cub['tb_s']:.2f} | "
            f"{dflt.get('us', float('nan')):.2f} | {best.get('us', float('nan')):.2f} | {best.get('tb_s', float('nan')):.2f} | "
            f"{ratio:.2f} | {best.get('name', '-')} | {r['best_no_pdl_us'] or float('nan'):.2f} |"
        )
    print(f"total {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
