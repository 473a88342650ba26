"""What a step with prefill chunks costs the GPU by its token count, and what padding to the
captured token counts costs a serving-like stream of steps.

A step that carries prefill chunks replays the CUDA graph of the smallest captured token count
that holds it (model_runner.MIXED_GRAPH_TOKENS); the padding rows go through every GEMM. This
captures graphs at many token counts on a random bf16 model (base only: padding rows belong to no
adapter segment, so LoRA adds nothing per padding row), times their replays (rounds interleaved,
medians), and then prices a serving-like step stream, `--decodes` running sequences plus k new
prompts a step (k Poisson with mean `--prompts-per-step`, lengths uniform in `--prompt-len`), under
two sets of captured token counts: the worker's and a finer one.

    python benchmarks/bench_step_tokens.py [--model llama-3.2-1b] [--decodes 62]
        [--prompts-per-step 0.73] [--prompt-len 64,256] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import SHAPES, config

from loraserve.inference_worker.engine import model_runner
from loraserve.inference_worker.engine.engine import EngineConfig, LLMEngine
from loraserve.inference_worker.model.llama import LlamaModel
from loraserve.inference_worker.model.tiny import word_tokenizer

FINE = tuple(range(64, 513, 32)) + tuple(range(576, 1025, 64)) + (1280, 1536, 1792, 2048, 3072)


def bucket(tokens: int, counts: list[int]) -> int:
    return next((c for c in counts if c >= tokens), counts[-1])


def replay_ms(graph: torch.cuda.CUDAGraph, n: int = 20) -> float:
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def kernel_table(graph: torch.cuda.CUDAGraph, title: str, replays: int = 20) -> list[dict]:
    """GPU time per kernel name of one replay (a profile over `replays`), largest first; printed."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0)
        if (
            us > 0 and e.count and str(getattr(e, "device_type", "")).endswith("CUDA")
        ):  # kernels, not host ops
            rows.append(
                {"kernel": e.key[:90], "us_per_step": us / replays, "calls_per_step": e.count / replays}
            )
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    print(f"\n{title}: {total:.0f} us of kernels a replay")
    print("| kernel | us a step | calls a step |\n| --- | ---: | ---: |")
    for r in rows[:18]:
        print(f"| {r['kernel'][:70]} | {r['us_per_step']:.1f} | {r['calls_per_step']:.0f} |")
    return rows


def step_stream(decodes: int, rate: float, lens: tuple[int, int], steps: int, budget: int) -> list[int]:
    """Token counts of a stream of steps: `decodes` decode rows plus Poisson(rate) prompts each."""
    rng = random.Random(0)
    out = []
    for _ in range(steps):
        k, p, limit = 0, rng.random(), pow(2.718281828459045, -rate)
        while p > limit:  # Knuth's Poisson draw
            k += 1
            p *= rng.random()
        out.append(min(budget, decodes + sum(rng.randint(*lens) for _ in range(k))) if k else 0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=tuple(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decodes", type=int, default=62)
    ap.add_argument("--prompts-per-step", type=float, default=0.73)
    ap.add_argument("--prompt-len", default="64,256")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--profile",
        default="",
        help="token counts (e.g. decode,256) whose graphs get a per-kernel GPU time table",
    )
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    dev = torch.device("cuda")
    cfg = config(args.model)
    model = LlamaModel(cfg, torch.bfloat16, dev)
    model.init_random(seed=0)
    worker_counts = [t for t in model_runner.MIXED_GRAPH_TOKENS if t < args.max_num_batched_tokens]
    worker_counts.append(args.max_num_batched_tokens)
    fine = sorted({t for t in FINE if t < args.max_num_batched_tokens} | set(worker_counts))
    model_runner.MIXED_GRAPH_TOKENS = tuple(fine)  # capture every count measured
    engine = LLMEngine(
        model,
        word_tokenizer(cfg.vocab_size),
        EngineConfig(
            max_num_seqs=args.max_num_seqs,
            max_model_len=2048,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=16,
            num_blocks=args.max_num_seqs * 128 + 1,
            use_cuda_graphs=True,
        ),
    )
    t0 = time.perf_counter()
    engine.runner.capture_graphs()
    capture_s = time.perf_counter() - t0
    mixed = engine.runner.mixed_graphs
    decode = engine.runner.graphs
    dbucket = bucket(args.decodes, sorted(decode))
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        times.setdefault("decode", []).append(replay_ms(decode[dbucket]))
        for t in sorted(mixed):
            times.setdefault(str(t), []).append(replay_ms(mixed[t]))
    ms = {k: statistics.median(v) for k, v in times.items()}
    stream = step_stream(args.decodes, args.prompts_per_step, (lo, hi), 20000, args.max_num_batched_tokens)
    measured = sorted(mixed)

    def mean_step_ms(counts: list[int]) -> float:
        return statistics.fmean(ms["decode"] if t == 0 else ms[str(bucket(t, counts))] for t in stream)

    def mean_padding(counts: list[int]) -> float:
        real = [t for t in stream if t]
        return statistics.fmean(bucket(t, counts) - t for t in real) / statistics.fmean(real)

    gpu = torch.cuda.get_device_name()
    rows = {
        "worker": {
            "counts": worker_counts,
            "mean_step_ms": mean_step_ms(worker_counts),
            "padding": mean_padding(worker_counts),
        },
        "fine": {
            "counts": measured,
            "mean_step_ms": mean_step_ms(measured),
            "padding": mean_padding(measured),
        },
    }
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": gpu,
        "model": args.model,
        "capture_s": round(capture_s, 1),
        "decode_bucket": dbucket,
        "replay_ms": {k: round(v, 4) for k, v in ms.items()},
        "stream": {
            "decodes": args.decodes,
            "prompts_per_step": args.prompts_per_step,
            "prompt_len": [lo, hi],
        },
        "stream_cost": rows,
    }
    for name in filter(None, args.profile.split(",")):
        graph = decode[dbucket] if name == "decode" else mixed[int(name)]
        out.setdefault("kernels", {})[name] = kernel_table(graph, f"{args.model}, {name} graph")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\n{gpu}, {args.model}, {len(measured)} mixed graphs captured in {capture_s:.1f} s")
    print("| tokens | replay ms |\n| ---: | ---: |")
    print(f"| decode {dbucket} | {ms['decode']:.3f} |")
    for t in measured:
        print(f"| {t} | {ms[str(t)]:.3f} |")
    print("\n| captured token counts | mean padding (share of real tokens) | mean step ms of the stream |")
    print("| --- | ---: | ---: |")
    for name, r in rows.items():
        print(f"| {name} ({len(r['counts'])}) | {r['padding']:.2f} | {r['mean_step_ms']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
