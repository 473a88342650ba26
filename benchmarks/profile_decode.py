"""Where a decode step's device time goes: every kernel of the worker's engine steps, by kind, for
the base engine and the LoRA engine, each with one feature on and off in one process (GPU):
`--compare pdl` the model's own kernels launched with programmatic dependent launch (PDL,
model/launch.py) or not; `--compare skinny` one-row steps' narrow projections on the skinny GEMM
(model/linear.py; with the norm fusion below) or on cuBLAS with the norms apart; `--compare norm`
one-row steps' RMSNorms folded into the q|k|v and gate | up projections (with RoPE + the KV-cache
write after q|k|v and SiLU x up after gate | up, model/skinny_norm.py) or apart, the skinny GEMM
on in both.

For a Llama-3.2-1B- and a Llama-3-8B-shaped random bf16 model (bench_lora_worker.py's shapes and
rank-16 adapters on all seven modules), each case decodes a batch and profiles `--steps` engine
steps (torch.profiler, CUDA activity): per step, the kernels of each kind (cuBLAS GEMMs, LoRA
shrink and expand, attention, RMSNorm, RoPE + KV write, SiLU x up, the rest), their summed time, and
the time the device was busy (the union of kernel intervals; with PDL two kernels may overlap). Then
the step's graph replayed alone, timed with CUDA events in rounds that alternate the two settings,
against the step's memory roofline (weights + adapters + KV read once at the measured copy
bandwidth).

    python benchmarks/profile_decode.py [--compare pdl|skinny|norm] [--shapes 1b,8b] [--steps 16] [--rounds 5]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import datetime
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# benchmarks/ is on the path as the script's folder
from bench_engine import copy_bandwidth
from bench_lora_worker import BATCH, PROMPT_LEN, bind, engine_config, hf_config, make_payload

from benchmarks.graph_timing import replay_us
from loraserve.inference_worker.builder import build_adapters
from loraserve.inference_worker.config import WorkerConfig
from loraserve.inference_worker.engine.engine import LLMEngine
from loraserve.inference_worker.engine.model_runner import kv_bytes_per_block
from loraserve.inference_worker.engine.sequence import SamplingParams
from loraserve.inference_worker.model import launch, linear
from loraserve.inference_worker.model.config import ModelConfig
from loraserve.inference_worker.model.llama import LlamaModel
from loraserve.inference_worker.model.tiny import word_tokenizer
from tests.helpers.adapter_sources import AdaptersRunning, PayloadSource

KINDS = (
    ("norm+gemm", ("_norm_skinny",)),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk", "skinny")),
    ("lora shrink", ("shrink",)),
    ("lora expand", ("expand",)),
    ("attention", ("_decode_part", "_decode_reduce")),
    ("rmsnorm", ("_rms_norm",)),
    ("rope+kv", ("_rope_cache",)),
    ("silu*up", ("_silu_mul",)),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def start(engine: LLMEngine, adapter_ids: list[str], vocab: int, tokens: int) -> list[str]:
    """Submits one request per entry of adapter_ids and steps until all decode; -> request ids."""
    g = torch.Generator().manual_seed(0)
    ids, first = [], []
    for i, aid in enumerate(adapter_ids):
        rid = f"p{i}-{time.monotonic_ns()}"
        prompt = torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist()
        seq = engine.make_sequence(
            rid, "", prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), first.append, aid
        )
        engine.submit(seq)
        ids.append(rid)
    while len(first) < len(adapter_ids):
        engine.step()
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    return ids


def stop(engine: LLMEngine, ids: list[str]) -> None:
    for rid in ids:
        engine.abort(rid)
    engine.step()
    torch.cuda.synchronize()


def kernel_profile(engine: LLMEngine, steps: int) -> dict:
    """Per step: kernels, summed time and busy time by kind; the top kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    spans = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for name, t0, t1 in spans:
        for table, key in ((by_kind, kind_of(name)), (by_name, name[:90])):
            table[key][0] += 1
            table[key][1] += t1 - t0
    busy, end = 0.0, float("-inf")  # union of the kernel intervals
    for _, t0, t1 in sorted(spans, key=lambda s: s[1]):
        if t1 > end:
            busy += t1 - max(t0, end)
            end = t1
    per = 1.0 / steps
    return {
        "busy_us": busy * per,
        "sum_us": sum(t1 - t0 for _, t0, t1 in spans) * per,
        "kinds": {k: {"count": c * per, "us": us * per} for k, (c, us) in sorted(by_kind.items())},
        "top": sorted(
            ({"name": n, "count": c * per, "us": us * per} for n, (c, us) in by_name.items()),
            key=lambda r: -r["us"],
        )[:14],
    }


@contextlib.contextmanager
def turned_off(model: LlamaModel, feature: str) -> Iterator[None]:
    """`feature` off for the engines built and graphs captured inside."""
    if feature == "pdl":
        with launch.pdl_off():
            yield
        return
    linears = model.grouped_linears().values() if feature == "skinny" else []
    saved = [m.skinny for m in linears]
    for m in linears:
        m.skinny = False
    try:
        with linear.norm_fusion_off():  # "norm", and "skinny": the fusion is a skinny kernel
            yield
    finally:
        for m, was in zip(linears, saved, strict=True):
            m.skinny = was


def replay_ms(engine: LLMEngine, batch: int, reps: int = 32) -> float:
    graph = engine.runner.graphs[next(k for k in sorted(engine.runner.graphs) if k >= batch)]
    return replay_us(graph, reps) / 1e3


def bench_shape(shape: str, args: argparse.Namespace, bw: float) -> dict:
    cfg = hf_config(shape)
    dev = torch.device("cuda")
    model = LlamaModel(ModelConfig.from_dict(cfg, f"random-{shape}"), torch.bfloat16, dev)
    model.init_random()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        payloads = list(pool.map(lambda i: make_payload(cfg, i), range(32)))
    config = WorkerConfig(
        model=f"random-{shape}",
        max_loras=32,
        max_lora_rank=16,
        max_cpu_loras=32,
        max_cpu_lora_mb=64 << 10,
        max_num_seqs=BATCH,
        max_num_batched_tokens=BATCH * PROMPT_LEN,
    )
    adapters = build_adapters(config, model, PayloadSource(payloads))
    running = AdaptersRunning(adapters)
    running.load(p.adapter_id for p in payloads)
    tokenizer = word_tokenizer(cfg["vocab_size"])
    engines: dict[str, LLMEngine] = {}
    for setting in ("on", "off"):
        with turned_off(model, args.compare) if setting == "off" else contextlib.nullcontext():
            for name, with_lora in (("base", None), ("lora", adapters)):
                engine = LLMEngine(model, tokenizer, engine_config(), with_lora)
                engine.runner.capture_graphs()
                engines[f"{name}, {args.compare} {setting}"] = engine
    kv_per_token = kv_bytes_per_block(model, 16) / 16
    cases = [("base", int(b), 0) for b in args.batches.split(",") if b] + [
        ("lora", BATCH, 1),
        ("lora", BATCH, 32),
    ]
    cases = [c for c in cases if c[0] == "base" or args.lora]
    out: dict = {"weights_gb": weight_bytes / 1e9, "adapter_mb": payloads[0].nbytes / 1e6, "cases": {}}
    for kind, batch, n in cases:
        label = f"{kind}, batch {batch}" + (f", {n} adapters" if n else "")
        row: dict = {}
        ids_of = ["" if n == 0 else f"bench-{i % n}" for i in range(batch)]
        replays: dict[str, list[float]] = {"on": [], "off": []}
        for setting in ("on", "off"):
            engine = engines[f"{kind}, {args.compare} {setting}"]
            bind(engine)
            running = start(engine, ids_of, cfg["vocab_size"], 64 + args.steps)
            row[f"profile_{setting}"] = kernel_profile(engine, args.steps)
            ctx = sum(s.num_tokens for s in engine.scheduler.running)  # the same prompts and steps
            row["kv_gb"] = ctx * kv_per_token / 1e9  # in both settings
            stop(engine, running)
        # the replay of the last decode step's graph (its inputs stay as the last step left them)
        for r in range(args.rounds):
            for setting in ("on", "off") if r % 2 == 0 else ("off", "on"):
                replays[setting].append(replay_ms(engines[f"{kind}, {args.compare} {setting}"], batch))
        roof = (weight_bytes + n * payloads[0].nbytes + row["kv_gb"] * 1e9) / bw * 1e3
        row["roofline_ms"] = roof
        for setting in ("on", "off"):
            med = statistics.median(replays[setting])
            row[f"replay_ms_{setting}"] = med
            row[f"replay_range_{setting}"] = (min(replays[setting]), max(replays[setting]))
        out["cases"][label] = row
        p_on, p_off = row["profile_on"], row["profile_off"]
        print(
            f"[{shape}] {label}: replay {row['replay_ms_on']:.3f} ms ({args.compare} on) / "
            f"{row['replay_ms_off']:.3f} ms (off); roofline {roof:.3f} ms; device busy "
            f"{p_on['busy_us']:.0f} / {p_off['busy_us']:.0f} us a step, kernel sum "
            f"{p_on['sum_us']:.0f} / {p_off['sum_us']:.0f} us",
            flush=True,
        )
        for k, v in p_on["kinds"].items():
            off = p_off["kinds"].get(k, {"count": 0, "us": 0.0})
            print(
                f"    {k:12s} {v['count']:6.1f} kernels  {v['us']:8.1f} us (off: {off['us']:8.1f})  "
                f"{v['us'] / max(v['count'], 1e-9):6.2f} us each",
                flush=True,
            )
        for t in p_on["top"]:
            print(f"      {t['us']:8.1f} us {t['count']:6.1f}x  {t['name']}", flush=True)
    del engines
    running.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--compare", choices=("pdl", "skinny", "norm"), default="pdl", help="the feature turned off"
    )
    ap.add_argument("--batches", default="1,64", help="base engine batches (the LoRA cases are at 64)")
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--steps", type=int, default=16, help="engine steps profiled per case")
    ap.add_argument("--rounds", type=int, default=5, help="replay rounds alternating the two settings")
    ap.add_argument("--no-lora", dest="lora", action="store_false", help="the base engine's cases only")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    results: dict = {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "copy_gbps": bw / 1e9,
        "compare": args.compare,
    }
    print(f"{results['gpu']}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    for shape in args.shapes.split(","):
        results[shape] = bench_shape(shape, args, bw)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    lines = [
        f"| shape | case | replay ms, {args.compare} on / off | roofline ms | on / roofline | off / roofline |"
    ]
    lines.append("| --- | --- | --- | ---: | ---: | ---: |")
    for shape in args.shapes.split(","):
        for label, row in results[shape]["cases"].items():
            on, off, roof = row["replay_ms_on"], row["replay_ms_off"], row["roofline_ms"]
            lines.append(
                f"| {shape} | {label} | {on:.3f} / {off:.3f} | {roof:.3f} | {on / roof:.2f}x | {off / roof:.2f}x |"
            )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
