"""Tensor-parallel decode throughput of the worker's engine (GPU; a CPU smoke mode).

For each TP size (1 and 2 by default) one process per rank — self-spawned, or started by torchrun
(then WORLD_SIZE is the one TP size measured) — runs a random model: the Llama-3-8B shape, and
70B-shaped layers (hidden 8192, 64/8 heads, intermediate 28672) with as many layers as fit one GPU
at TP=1 (the same count at every TP size, so the sizes compare). Rank 0 runs the worker's engine
with its LeaderRunner (each step's plan and slot changes go to the followers over gloo, as in
`loraserve worker --tensor-parallel-size N`); the followers run the worker's follower loop.
Per shape, TP size and batch (1 and 64):
  - decode tok/s with base rows only and with 32 distinct rank-16 adapters on all seven modules
    (one per row, round robin), CUDA graphs on;
  - the collectives of one decode step replayed alone, same sizes and order (captured in a CUDA
    graph on GPU): ms for the base model's (embedding and two all-reduces per layer, the logits
    all-gather) and for the adapters' (two rank-sized all-reduces per layer), and their share of
    the measured step time.

    python benchmarks/bench_tp.py [--tp 1,2] [--shape 8b,70b] [--batches 1,64] [--adapters 0,32] [--json out.json]
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --shape 8b
    python benchmarks/bench_tp.py --device cpu --shape tiny      # smoke: gloo, a few seconds
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.bench_lora_worker import PROMPT_LEN, RANK, decode_run, distinct_ids, make_payload
from benchmarks.bench_lora_worker import SHAPES as WORKER_SHAPES
from benchmarks.bench_lora_worker import hf_config as worker_hf_config
from loraserve.inference_worker.builder import build_adapters, build_leader, engine_config_for
from loraserve.inference_worker.config import WorkerConfig
from loraserve.inference_worker.engine.engine import LLMEngine
from loraserve.inference_worker.model.config import ModelConfig
from loraserve.inference_worker.model.llama import LlamaModel
from loraserve.inference_worker.model.sharded_llama import ShardedLlamaModel
from loraserve.inference_worker.model.tiny import word_tokenizer
from loraserve.inference_worker.parallel.follower import build_runner, follow
from loraserve.inference_worker.parallel.group import TensorParallelGroup
from loraserve.inference_worker.parallel.launcher import FollowerProcesses
from loraserve.inference_worker.parallel.leader import LeaderRunner
from loraserve.inference_worker.parallel.step_channel import Kind, StepChannel
from tests.helpers.adapter_sources import AdaptersRunning, PayloadSource

# the worker benchmark's 8B and smoke-test shapes, plus 70B-shaped layers
SHAPES: dict[str, dict[str, Any]] = {
    "8b": WORKER_SHAPES["8b"],
    # num_hidden_layers 0: as many as fit one GPU at TP=1 (--layers-70b overrides)
    "70b": dict(
        WORKER_SHAPES["8b"],
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=0,
        num_attention_heads=64,
    ),
    "tiny": WORKER_SHAPES["tiny"],
}
MEMORY_SHARE = 0.6  # of a GPU's free memory for the 70B-shaped layers at TP=1 (weights and slots)


def hf_config(shape: str, num_layers: int) -> dict:
    """The worker benchmark's config with this benchmark's shape (`num_layers` 0: the shape's)."""
    cfg = {**worker_hf_config("8b"), **SHAPES[shape], "_name_or_path": f"random-{shape}"}
    if num_layers:
        cfg["num_hidden_layers"] = num_layers
    return cfg


def layers_that_fit(cfg: dict, num_adapters: int, dtype: torch.dtype, device: torch.device) -> int:
    """Decoder layers (whole, TP=1) plus their adapter slots that fit MEMORY_SHARE of the free memory."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    weights = h * (q + 2 * kv) + q * h + 3 * h * i
    slots = num_adapters * RANK * (3 * h + (q + 2 * kv) + q + h + 2 * h + 2 * i + i + h)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 64 << 30
    budget = MEMORY_SHARE * free - 2 * v * h * dtype.itemsize
    return max(1, int(budget // ((weights + slots) * dtype.itemsize)))


def collective_times(
    tp: TensorParallelGroup | None, model: LlamaModel, batch: int, reps: int
) -> dict[str, float]:
    """ms per decode step of the base model's collectives and of the adapters', replayed alone."""
    if tp is None:
        return {"base_collectives_ms": 0.0, "lora_collectives_ms": 0.0}
    cfg, dev = model.config, model.device
    x = torch.zeros(batch, cfg.hidden_size, dtype=model.dtype, device=dev)  # [B, hidden]
    local_logits = torch.zeros(batch, model.dims.vocab_rows, dtype=model.dtype, device=dev)
    s = torch.zeros(1, batch, RANK, dtype=torch.float32, device=dev)  # a row-parallel shrink [S, B, R]

    def base() -> None:
        for _ in range(1 + 2 * cfg.num_layers):
            tp.all_reduce(x)
        tp.all_gather_columns(local_logits)

    def lora() -> None:
        for _ in range(2 * cfg.num_layers):
            tp.all_reduce(s)

    return {
        "base_collectives_ms": _time_ms(base, dev, reps),
        "lora_collectives_ms": _time_ms(lora, dev, reps),
    }


def _time_ms(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    run = fn
    if device.type == "cuda":
        for _ in range(2):
            fn()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    times = []
    for _ in range(max(3, reps)):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(10):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) / 10 * 1e3)
    return statistics.median(times)


def bench_shape(
    shape: str, args: argparse.Namespace, tp: TensorParallelGroup | None, device: torch.device
) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    counts = [int(n) for n in args.adapters.split(",")]
    num_adapters = max(1, *counts)
    cfg = hf_config(shape, args.layers_70b if shape == "70b" else 0)
    if not cfg["num_hidden_layers"]:
        fit = layers_that_fit(cfg, num_adapters, dtype, device)
        cfg["num_hidden_layers"] = tp.min_over_ranks(fit) if tp is not None else fit
    mcfg = ModelConfig.from_dict(cfg, f"random-{shape}")
    model = ShardedLlamaModel(mcfg, dtype, device, tp) if tp is not None else LlamaModel(mcfg, dtype, device)
    model.init_random()
    max_batch, max_len = max(batches), PROMPT_LEN + args.tokens + 16
    config = WorkerConfig(
        model=f"random-{shape}",
        device=device.type,
        dtype=str(dtype).removeprefix("torch."),
        max_num_seqs=max_batch,
        max_num_batched_tokens=max_batch * PROMPT_LEN,
        max_model_len=max_len,
        num_kv_blocks=max_batch * (-(-max_len // 16)) + 16,
        max_loras=num_adapters,
        max_cpu_loras=num_adapters,
        max_lora_rank=RANK,
        max_cpu_lora_mb=256 << 10,
        adapter_lookahead=0,
        adapter_prefetch=0,
        cuda_graphs=device.type == "cuda",
        tensor_parallel_size=tp.size if tp is not None else 1,
    )
    rows: list[dict] = []
    if tp is None or tp.rank == 0:
        payloads = [make_payload(cfg, i) for i in range(num_adapters)]
        tokenizer = word_tokenizer(cfg["vocab_size"])
        source = PayloadSource(payloads)
        if tp is not None:
            worker = build_leader(config, model, tokenizer, source, tp, FollowerProcesses([]))
            engine, adapters = worker.engine, worker.adapters
        else:
            adapters = build_adapters(config, model, source)
            engine = LLMEngine(model, tokenizer, engine_config_for(config, model), adapters)
        assert adapters is not None
        running = AdaptersRunning(adapters)
        running.load(p.adapter_id for p in payloads)
        engine.runner.capture_graphs()
        for batch in batches:
            for n in counts:
                tps = [
                    decode_run(engine, distinct_ids(n, batch), cfg["vocab_size"], args.tokens)
                    for _ in range(args.reps)
                ]
                rows.append({"batch": batch, "adapters": min(n, batch), "tok_s": statistics.median(tps)})
        if isinstance(engine.runner, LeaderRunner):
            engine.runner.channel.send(Kind.STOP)  # the followers leave this shape's loop
        running.close()
    else:
        runner, slots = build_runner(config, tp, model)
        follow(runner, slots, StepChannel(tp.cpu_group))
    coll = {b: collective_times(tp, model, b, args.reps) for b in batches}
    for row in rows:
        step_ms = row["batch"] / row["tok_s"] * 1e3
        c = coll[row["batch"]]
        lora_ms = c["lora_collectives_ms"] if row["adapters"] else 0.0
        row |= {"step_ms": step_ms, **c, "collectives_share": (c["base_collectives_ms"] + lora_ms) / step_ms}
        row["lora_collectives_share"] = lora_ms / step_ms
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"shape": shape, "num_layers": cfg["num_hidden_layers"], "rows": rows}


def run_rank(rank: int, size: int, args: argparse.Namespace, port: int, out: Any) -> None:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    tp = None
    if size > 1:
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun hosts the store
        store = dist.TCPStore(
            "127.0.0.1" if not agent else os.environ["MASTER_ADDR"], port, size, rank == 0 and not agent
        )
        tp = TensorParallelGroup.initialize(rank, size, device, store)
    results = [bench_shape(shape, args, tp, device) for shape in args.shape.split(",")]
    if rank == 0:
        out.put(
            {
                "tp": size,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "shapes": results,
            }
        )
    if tp is not None:
        tp.close()


def _spawned(rank: int, size: int, args: argparse.Namespace, port: int, out: Any) -> None:
    run_rank(rank, size, args, port, out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_table(results: list[dict]) -> None:
    print(
        "| shape | layers | TP | batch | adapters | tok/s | step ms | collectives ms (base + LoRA) | share of step | LoRA's share |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for res in results:
        for sh in res["shapes"]:
            for r in sh["rows"]:
                lora_ms = r["lora_collectives_ms"] if r["adapters"] else 0.0
                print(
                    f"| {sh['shape']} | {sh['num_layers']} | {res['tp']} | {r['batch']} | {r['adapters']} | "
                    f"{r['tok_s']:.0f} | {r['step_ms']:.2f} | {r['base_collectives_ms']:.3f} + {lora_ms:.3f} | "
                    f"{100 * r['collectives_share']:.1f}% | {100 * r['lora_collectives_share']:.1f}% |"
                )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo, the smoke mode")
    p.add_argument("--shape", default="8b,70b", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument(
        "--tp", default="1,2", help="TP sizes, each run as its own set of processes (torchrun: WORLD_SIZE)"
    )
    p.add_argument("--batches", default="1,64")
    p.add_argument("--adapters", default="0,32", help="distinct adapters per batch (0 = base rows only)")
    p.add_argument("--tokens", type=int, default=64, help="decode steps per measurement")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--layers-70b", type=int, default=0, help="layers of the 70B shape (0: as many as fit at TP=1)"
    )
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; run with --device cpu --shape tiny for the smoke mode", file=sys.stderr)
        return 2
    results: list[dict] = []
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # started by torchrun: one TP size
        queue: Any = multiprocessing.Queue() if int(os.environ["RANK"]) == 0 else None
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        run_rank(rank, size, args, int(os.environ["MASTER_PORT"]), queue)
        if rank != 0:
            return 0
        results.append(queue.get())
    else:
        ctx = multiprocessing.get_context("spawn")
        for size in (int(t) for t in args.tp.split(",")):
            queue = ctx.Queue()
            port = free_port()
            procs = [ctx.Process(target=_spawned, args=(r, size, args, port, queue)) for r in range(size)]
            for proc in procs:
                proc.start()
            results.append(queue.get(timeout=3600))
            for proc in procs:
                proc.join(60)
                if proc.exitcode != 0:
                    print(f"rank process exited with {proc.exitcode}", file=sys.stderr)
                    return 1
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
