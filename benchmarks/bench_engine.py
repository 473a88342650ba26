"""Decode throughput of the worker's engine on a GPU, against the memory roofline.

Builds Llama-3.2-1B- and Llama-3-8B-shaped models with random bf16 weights directly on the GPU (no
files), then for each decode batch size B: B requests with PROMPT_LEN-token prompts are prefilled,
and STEPS decode steps are timed through `LLMEngine.step()` (scheduling, CUDA-graph replay,
sampling, detokenization: what a served request pays) with the worker's settings (asynchronous
scheduling, its garbage-collector tuning) and, interleaved in each round: with the text of each
token made elsewhere (`SamplingParams.detokenize` False: the worker's front process makes the text of
plain streams, so its step thread emits tokens only), without asynchronous scheduling, and with
Python's default garbage collector. The roofline time of one decode step is
(weight bytes + KV bytes of all contexts) / device-to-device copy bandwidth, the bandwidth measured
here with a large torch copy (read + write bytes / time).

    python benchmarks/bench_engine.py [--models llama-3.2-1b,llama-3-8b] [--batches 1,16,64,256]
        [--batches-1b 1,64,256] [--batches-8b 1,64] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from loraserve.inference_worker.engine.engine import EngineConfig, LLMEngine
from loraserve.inference_worker.engine.model_runner import kv_bytes_per_block
from loraserve.inference_worker.engine.sequence import SamplingParams
from loraserve.inference_worker.engine.text_stream import NO_TEXT
from loraserve.inference_worker.model.config import ModelConfig
from loraserve.inference_worker.model.llama import LlamaModel
from loraserve.inference_worker.model.tiny import word_tokenizer
from loraserve.serving.gc_tuning import python_default_gc, tune_gc

SHAPES = {
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "llama-3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}
PROMPT_LEN = 128
STEPS = 32
REPS = 5  # rounds of [STEPS engine steps; STEPS replays of the same step's graph], interleaved
RUNS = 4  # engine step runs a round: asynchronous, text made by the front, synchronous, default GC


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-device copy (bytes read + written)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    n = 20
    t0 = time.perf_counter()
    for _ in range(n):
        dst.copy_(src)
    torch.cuda.synchronize()
    bw = 2 * src.numel() * n / (time.perf_counter() - t0)
    del src, dst
    return bw


def per_call(fn: Callable[[], object]) -> float:
    """Seconds per call of `fn` over STEPS calls, the device drained after them."""
    t0 = time.perf_counter()
    for _ in range(STEPS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / STEPS


def per_call_without_text(engine: LLMEngine) -> float:
    """`per_call(engine.step)` with every running sequence's text made elsewhere (as the worker's
    front makes it for plain streams): its text stream is set aside for the run, then brought up
    to date outside the timing."""
    running = list(engine.scheduler.running)
    streams = [seq.text_stream for seq in running]
    for seq in running:
        seq.text_stream = NO_TEXT
    try:
        return per_call(engine.step)
    finally:
        for seq, stream in zip(running, streams, strict=True):
            seq.text_stream = stream
            stream.feed(seq.output_token_ids)
            stream.take(False)


def config(name: str) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 128256,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
            "eos_token_id": 128001,
            **SHAPES[name],
        },
        name=name,
    )


def print_kernel_profile(graph: torch.cuda.CUDAGraph, name: str) -> None:
    """GPU time per kernel of one decode step (graph replays under the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    print(f"--- {name}, batch 1: GPU time per kernel over 10 steps", flush=True)
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60),
        flush=True,
    )


def bench_model(
    name: str, batches: list[int], bw: float, device: torch.device, profile: bool = False
) -> list[dict]:
    cfg = config(name)
    model = LlamaModel(cfg, torch.bfloat16, device)
    model.init_random(seed=0)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    block_size = 16
    max_len = -(-(PROMPT_LEN + RUNS * REPS * STEPS + 8) // block_size) * block_size
    max_b = max(batches)
    num_blocks = max_b * (max_len // block_size) + 1
    t0 = time.perf_counter()
    engine = LLMEngine(
        model,
        word_tokenizer(cfg.vocab_size),
        EngineConfig(
            max_num_seqs=max_b,
            max_model_len=max_len,
            max_num_batched_tokens=8192,
            block_size=block_size,
            num_blocks=num_blocks,
            max_queue_size=max_b,
            use_cuda_graphs=True,
        ),
    )
    engine.runner.capture_graphs()
    capture_s = time.perf_counter() - t0
    kv_per_token = kv_bytes_per_block(model, block_size) / block_size
    rows = []
    g = torch.Generator().manual_seed(1)
    for b in batches:
        outs: list[list] = [[] for _ in range(b)]
        for i in range(b):
            ids = torch.randint(0, cfg.vocab_size, (PROMPT_LEN,), generator=g).tolist()
            engine.submit(
                engine.make_sequence(
                    f"{name}-{b}-{i}",
                    "",
                    ids,
                    SamplingParams(max_tokens=RUNS * REPS * STEPS + 8, ignore_eos=True),
                    outs[i].append,
                )
            )
        while not all(outs):  # prefill everyone (first token out)
            engine.step()
        for _ in range(3):  # warm-up decode steps
            engine.step()
        torch.cuda.synchronize()
        ctx = [s.num_tokens for s in engine.scheduler.running]
        bucket = next(k for k in sorted(engine.runner.graphs) if k >= b)
        graph = engine.runner.graphs[bucket]
        tune_gc()  # as the worker does once it is up
        step_times, replay_times, sync_times, gc_times, front_times = [], [], [], [], []
        for _ in range(REPS):
            step_times.append(per_call(engine.step))
            # as the worker serves plain streams: its front makes the text from the tokens
            front_times.append(per_call_without_text(engine))
            # the same steps with each step's tokens read back before the next is planned
            engine.set_async_scheduling(False)
            sync_times.append(per_call(engine.step))
            # graph replay alone (no host work): the GPU time of one step; here, after a step
            # whose inputs were all on the host, a replay repeats that step exactly
            replay_times.append(per_call(graph.replay))
            engine.set_async_scheduling(True)
            with python_default_gc():
                gc_times.append(per_call(engine.step))
        step_s, replay_s = statistics.median(step_times), statistics.median(replay_times)
        front_s = statistics.median(front_times)
        sync_s, gc_s = statistics.median(sync_times), statistics.median(gc_times)
        if profile and b == 1:
            print_kernel_profile(graph, name)
        kv_bytes = sum(c + RUNS * REPS * STEPS // 2 for c in ctx) * kv_per_token  # contexts at mid-run
        roof_s = (weight_bytes + kv_bytes) / bw
        rows.append(
            dict(
                model=name,
                batch=b,
                tok_s=b / step_s,
                step_ms=step_s * 1e3,
                step_ms_range=(min(step_times) * 1e3, max(step_times) * 1e3),
                replay_ms=replay_s * 1e3,
                replay_ms_range=(min(replay_times) * 1e3, max(replay_times) * 1e3),
                engine_over_replay=step_s / replay_s,
                front_ms=front_s * 1e3,
                front_ms_range=(min(front_times) * 1e3, max(front_times) * 1e3),
                front_over_replay=front_s / replay_s,
                sync_ms=sync_s * 1e3,
                sync_over_replay=sync_s / replay_s,
                gc_default_ms=gc_s * 1e3,
                gc_default_over_replay=gc_s / replay_s,
                roof_ms=roof_s * 1e3,
                ratio=step_s / roof_s,
                replay_ratio=replay_s / roof_s,
                weights_gb=weight_bytes / 1e9,
                kv_gb=kv_bytes / 1e9,
                capture_s=capture_s,
            )
        )
        for i in range(b):
            engine.abort(f"{name}-{b}-{i}")
        engine.step()
        print(rows[-1], flush=True)
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.2-1b,llama-3-8b")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--batches-1b", default=None, help="batches of the 1B shape (default: --batches)")
    ap.add_argument("--batches-8b", default=None, help="batches of the 8B shape (default: --batches)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="print a per-kernel profile of batch-1 steps")
    args = ap.parse_args()
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    gpu = torch.cuda.get_device_name(device)
    print(f"{gpu}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for name in args.models.split(","):
        own = args.batches_1b if "1b" in name else args.batches_8b
        batches = [int(b) for b in (own or args.batches).split(",")]
        rows += bench_model(name, batches, bw, device, args.profile)
    lines = [
        f"GPU: {gpu}; torch {torch.__version__}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"Measured device-to-device copy bandwidth: {bw / 1e9:.0f} GB/s (read + write).",
        f"Random bf16 weights, prompts of {PROMPT_LEN} tokens, CUDA graphs on, the worker's GC settings; {REPS} "
        f"interleaved rounds of {STEPS} engine steps each way and {STEPS} graph replays: medians (min-max).",
        "",
        "| model | batch | decode tok/s | step ms (engine) | step ms (graph replay) | engine / replay | "
        "step ms, text made by the front | engine / replay, text made by the front | "
        "engine / replay, synchronous scheduling | engine / replay, Python's default GC | "
        "roofline ms | engine / roofline | replay / roofline | weights GB | KV read GB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['tok_s']:.0f} | {r['step_ms']:.2f} "
            f"({r['step_ms_range'][0]:.2f}-{r['step_ms_range'][1]:.2f}) | {r['replay_ms']:.2f} "
            f"({r['replay_ms_range'][0]:.2f}-{r['replay_ms_range'][1]:.2f}) | {r['engine_over_replay']:.2f}x | "
            f"{r['front_ms']:.2f} ({r['front_ms_range'][0]:.2f}-{r['front_ms_range'][1]:.2f}) | "
            f"{r['front_over_replay']:.2f}x | "
            f"{r['sync_over_replay']:.2f}x ({r['sync_ms']:.2f} ms) | "
            f"{r['gc_default_over_replay']:.2f}x ({r['gc_default_ms']:.2f} ms) | "
            f"{r['roof_ms']:.2f} | {r['ratio']:.2f}x | {r['replay_ratio']:.2f}x | {r['weights_gb']:.2f} | "
            f"{r['kv_gb']:.3f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
