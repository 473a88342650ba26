"""Multi-LoRA decode throughput of the worker's engine, and slot activation time (GPU).

For a Llama-3.2-1B- and a Llama-3-8B-shaped random bf16 model, rank-16 adapters on all seven
modules, optimized in-process by the store's optimizer and loaded through the worker's own adapter
admin path from an in-memory source (no gRPC, no store server):
  - decode tokens/s with 0 (base rows only), 1, 8, 32 and 64 distinct adapters in a batch of 64,
    against an engine with no adapters (base) over the same model, in one process: every case once
    per round, rounds repeated with the order rotated, medians and spread reported; the LoRA engine
    once with the default launch options and once with programmatic dependent launch flipped;
  - with --peft, transformers + peft on the same GPU (`generate(adapter_names=...)`, one adapter per row);
  - activation of an 8B-shaped adapter (~84 MB) from pinned CPU into a GPU slot, against a plain
    host-to-device copy of the same bytes.

    python benchmarks/bench_lora_worker.py [--shapes 1b,8b] [--adapters 0,1,8,32,64] [--reps 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loraserve.adapter_store.optimize import optimize
from loraserve.adapter_store.validate import LoraAdapter, LoraModule, scale_of
from loraserve.contract.adapter_layout import MODULES, module_shapes
from loraserve.contract.payload import PayloadTensor
from loraserve.inference_worker.adapters.worker_adapters import WorkerAdapters
from loraserve.inference_worker.builder import build_adapters
from loraserve.inference_worker.config import WorkerConfig
from loraserve.inference_worker.engine.engine import EngineConfig, LLMEngine
from loraserve.inference_worker.engine.sequence import SamplingParams
from loraserve.inference_worker.lora.layer import LoRALayer, worker_launch_options
from loraserve.inference_worker.lora.payload import AdapterPayload
from loraserve.inference_worker.model import launch
from loraserve.inference_worker.model.config import ModelConfig
from loraserve.inference_worker.model.llama import LlamaModel
from loraserve.inference_worker.model.tiny import word_tokenizer
from loraserve.kernels import LaunchOptions
from loraserve.kernels.launch_options import pdl_supported
from tests.helpers.adapter_sources import AdaptersRunning, PayloadSource

SHAPES = {
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
    ),
    # a smoke-test shape (runs on CPU too)
    "tiny": dict(
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
}
RANK, ALPHA = 16, 32.0
BATCH, PROMPT_LEN, DECODE_TOKENS = 64, 16, 128


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_config(shape: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "_name_or_path": f"random-{shape}",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "attention_bias": False,
        **SHAPES[shape],
    }


def make_payload(cfg: dict, i: int) -> AdapterPayload:
    """A rank-16 all-module adapter, optimized by the store's optimizer (bf16, layout v1)."""
    g = torch.Generator().manual_seed(1000 + i)
    shapes = module_shapes(cfg)
    modules = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in MODULES:
            n_in, n_out = shapes[m]
            a = torch.randn(RANK, n_in, generator=g) * 0.02
            b = torch.randn(n_out, RANK, generator=g) * 0.02
            modules[(layer, m)] = LoraModule(layer, m, RANK, ALPHA, scale_of(ALPHA, RANK, False), a, b)
    opt = optimize(LoraAdapter(modules, RANK, ALPHA, False), cfg, "bfloat16")
    tensors = [PayloadTensor(t.name, t.shape, t.dtype, t.offset, t.nbytes) for t in opt.tensors]
    return AdapterPayload(f"bench-{i}", opt.digest, opt.rank, opt.payload, tensors)


def decode_run(engine: LLMEngine, adapter_ids: list[str], vocab: int, tokens: int = DECODE_TOKENS) -> float:
    """Decode tokens/s of one batch (all prompts prefill in the first step; every later step
    decodes all rows)."""
    g = torch.Generator().manual_seed(0)
    done: list[int] = []
    for i, aid in enumerate(adapter_ids):
        prompt = torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist()
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        seq = engine.make_sequence(
            f"r{i}-{time.monotonic_ns()}",
            "",
            prompt,
            params,
            lambda out: done.append(1) if out.finished else None,
            aid,
        )
        engine.submit(seq)
    engine.step()  # prefill of every row + first token
    sync()
    t0 = time.perf_counter()
    steps = 0
    while len(done) < len(adapter_ids):
        engine.step()
        steps += 1
    sync()
    return len(adapter_ids) * steps / (time.perf_counter() - t0)


def distinct_ids(n: int, batch: int) -> list[str]:
    return ["" if n == 0 else f"bench-{i % n}" for i in range(batch)]


def tokens_of(engine: LLMEngine, adapter_ids: list[str], vocab: int, n: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    outs: dict[int, list[int]] = {i: [] for i in range(len(adapter_ids))}
    finished: list[int] = []
    for i, aid in enumerate(adapter_ids):
        prompt = torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist()

        def cb(out, i=i) -> None:
            outs[i].extend(out.token_ids)
            if out.finished:
                finished.append(i)

        engine.submit(
            engine.make_sequence(
                f"t{i}-{time.monotonic_ns()}",
                "",
                prompt,
                SamplingParams(max_tokens=n, ignore_eos=True),
                cb,
                aid,
            )
        )
    while len(finished) < len(adapter_ids):
        engine.step()
    return [outs[i] for i in range(len(adapter_ids))]


def engine_config(graphs: bool = True) -> EngineConfig:
    return EngineConfig(
        max_num_seqs=BATCH,
        max_model_len=256,
        max_num_batched_tokens=BATCH * PROMPT_LEN,
        block_size=16,
        num_blocks=BATCH * 16 + 64,
        max_queue_size=1024,
        use_cuda_graphs=graphs,
    )


def activation_times(adapters: WorkerAdapters, payload: AdapterPayload, reps: int = 10) -> dict:
    dev = adapters.pool.slots.device
    dst = torch.empty(payload.nbytes, dtype=torch.uint8, device=dev)
    h2d, act = [], []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        dst.copy_(payload.data, non_blocking=True)
        sync()
        h2d.append(time.perf_counter() - t0)
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        adapters.pool.slots.load(0, payload)
        sync()
        act.append(time.perf_counter() - t0)
    h, a = statistics.median(h2d), statistics.median(act)
    return {
        "bytes": payload.nbytes,
        "h2d_ms": h * 1e3,
        "h2d_gbps": payload.nbytes / h / 1e9,
        "activation_ms": a * 1e3,
        "ratio": a / h,
    }


def peft_throughput(cfg: dict, n_adapters: int, batch: int, new_tokens: int) -> float:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "_name_or_path")})
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(hf)
    finally:
        torch.set_default_dtype(torch.float32)
    model.eval()
    lcfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(MODULES), init_lora_weights=False)
    pm = get_peft_model(model, lcfg, adapter_name="a0")
    for i in range(1, n_adapters):
        pm.add_adapter(f"a{i}", lcfg)
    pm.to(torch.bfloat16)
    pm.eval()
    ids = torch.randint(3, cfg["vocab_size"], (batch, PROMPT_LEN), device="cuda")
    names = [f"a{i % n_adapters}" for i in range(batch)]
    kw = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        adapter_names=names,
        do_sample=False,
        pad_token_id=0,
    )
    with torch.no_grad():
        pm.generate(**kw, max_new_tokens=2, min_new_tokens=2)
        sync()
        t0 = time.perf_counter()
        pm.generate(**kw, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        sync()
    tps = batch * new_tokens / (time.perf_counter() - t0)
    del pm, model
    return tps


def bind(engine: LLMEngine) -> None:
    """Points the model's attention layers at `engine`'s KV cache: several engines share one model
    here, and eager (prefill) steps read the cache the layers hold; replayed graphs keep their own."""
    kv = engine.runner.kv_cache
    for i, layer in enumerate(engine.runner.model.layers):
        layer.self_attn.k_cache, layer.self_attn.v_cache = kv[i, 0], kv[i, 1]


def set_launch_options(
    model: LlamaModel, options: LaunchOptions, side_stream: torch.cuda.Stream | None = None
) -> None:
    """Launch options of every LoRA layer, and the stream its shrink runs on beside the base
    GEMM (None: shrink and expand together after the GEMM)."""
    for module in model.grouped_linears().values():
        if isinstance(module.lora, LoRALayer):
            module.lora.options, module.lora.side_stream = options, side_stream


def interleaved_decode(
    engines: dict[str, LLMEngine], cases: list[tuple[str, str, int]], vocab: int, reps: int
) -> dict[str, list[float]]:
    """tok/s of every case (label, engine name, distinct adapters in a batch of 64), `reps` rounds;
    each round runs every case once, the order rotated by one case per round, so slow drifts
    (clocks, temperature) spread over all cases instead of biasing the ones run last."""
    tps: dict[str, list[float]] = {label: [] for label, _, _ in cases}
    for rep in range(reps):
        k = rep % len(cases)
        for label, name, n in cases[k:] + cases[:k]:
            bind(engines[name])
            tps[label].append(decode_run(engines[name], distinct_ids(n, BATCH), vocab))
    return tps


def summarize(tps: dict[str, list[float]], base: str) -> dict[str, dict[str, float]]:
    """Median and spread of tok/s per case, and % of base as the median of per-round ratios (each
    round's case against the same round's base run)."""
    out = {}
    for label, values in tps.items():
        ratios = [v / b for v, b in zip(values, tps[base], strict=True)]
        out[label] = {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "pct_of_base": 100 * statistics.median(ratios),
            "pct_min": 100 * min(ratios),
            "pct_max": 100 * max(ratios),
        }
    return out


def bench_shape(shape: str, results: dict, args: argparse.Namespace) -> None:
    cfg = hf_config(shape)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    counts = [int(n) for n in args.adapters.split(",")]
    num_payloads = max(max(counts), 5)
    t0 = time.perf_counter()
    model = LlamaModel(ModelConfig.from_dict(cfg, f"random-{shape}"), torch.bfloat16, dev)
    model.init_random()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        payloads = list(pool.map(lambda i: make_payload(cfg, i), range(num_payloads)))
    slots = max(args.max_loras, num_payloads)
    config = WorkerConfig(
        model=f"random-{shape}",
        max_loras=slots,
        max_lora_rank=RANK,
        max_cpu_loras=slots,
        max_cpu_lora_mb=64 << 10,
        max_num_seqs=BATCH,
        max_num_batched_tokens=BATCH * PROMPT_LEN,
    )
    adapters = build_adapters(config, model, PayloadSource(payloads))
    running = AdaptersRunning(adapters)  # loads through the worker's own admin path
    running.load(p.adapter_id for p in payloads)
    print(
        f"[{shape}] model + {num_payloads} adapters ({payloads[0].nbytes / 1e6:.1f} MB each) in "
        f"{time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    r: dict = {"adapter_mb": payloads[0].nbytes / 1e6}
    vocab = cfg["vocab_size"]
    tokenizer = word_tokenizer(vocab)  # random weights have no vocabulary: token i is the word w{i}
    default = worker_launch_options(dev)
    r["default_options"] = dataclasses.asdict(default)

    # correctness: graph replays with LoRA == eager steps with LoRA; adapters change the output.
    ids8 = ["", "bench-0", "bench-1", "bench-2", "", "bench-0", "bench-3", "bench-4"]
    eager = LLMEngine(model, tokenizer, engine_config(graphs=False), adapters)
    eager_tokens = tokens_of(eager, ids8, vocab)
    del eager
    # one process, one model: a base engine (no adapter manager) and a LoRA engine per launch
    # variant, each with its own KV cache and graphs (captured with that variant's launches)
    engines = {"base": LLMEngine(model, tokenizer, engine_config())}
    engines["base"].runner.capture_graphs()
    if args.model_pdl_variants:  # base and LoRA engines whose own model kernels launch without PDL
        with launch.pdl_off():
            engines["base, model PDL off"] = LLMEngine(model, tokenizer, engine_config())
            engines["base, model PDL off"].runner.capture_graphs()
            set_launch_options(model, default)
            engines["model PDL off"] = LLMEngine(model, tokenizer, engine_config(), adapters)
            engines["model PDL off"].runner.capture_graphs()
    side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    variants: dict[str, tuple[LaunchOptions, torch.cuda.Stream | None]] = {"default": (default, None)}
    if args.fused_silu_variant:  # the gate | up expand writing the activation at decode sizes too
        variants["fused_silu_mul=True"] = (dataclasses.replace(default, fused_silu_mul=True), None)
    if dev.type == "cuda" and pdl_supported(dev) and args.pdl_variants:
        variants[f"pdl={not default.pdl}"] = (dataclasses.replace(default, pdl=not default.pdl), None)
        if default.pdl:  # the shrink launched with PDL too, or not
            flipped = dataclasses.replace(default, pdl_shrink=not default.pdl_shrink)
            variants[f"pdl_shrink={flipped.pdl_shrink}"] = (flipped, None)
    if side is not None and args.side_stream:
        variants["shrink beside GEMM"] = (default, side)
    for name, (options, stream) in variants.items():
        set_launch_options(model, options, stream)
        engines[name] = LLMEngine(model, tokenizer, engine_config(), adapters)
        engines[name].runner.capture_graphs()  # what engine.start() does; the benchmark steps engines itself
    set_launch_options(model, default)
    lora = engines["default"]
    bind(lora)
    graph_tokens = tokens_of(lora, ids8, vocab)
    base_tokens = tokens_of(lora, [""] * 8, vocab)
    r["graph_eq_eager_rows"] = sum(a == b for a, b in zip(graph_tokens, eager_tokens, strict=True))
    r["adapter_rows_differ_from_base"] = sum(graph_tokens[i] != base_tokens[i] for i in (1, 2, 3, 5, 6, 7))
    print(
        f"[{shape}] graph==eager rows {r['graph_eq_eager_rows']}/8, adapter rows != base "
        f"{r['adapter_rows_differ_from_base']}/6",
        flush=True,
    )

    cases = [("base engine", "base", 0)]
    if args.model_pdl_variants:
        cases.append(("base engine, model PDL off", "base, model PDL off", 0))
    for name in [*variants, *(["model PDL off"] if args.model_pdl_variants else [])]:
        cases += [(f"LoRA {name}, {n} adapters", name, n) for n in counts]
    for name, engine in engines.items():  # warm up every engine
        bind(engine)
        decode_run(engine, distinct_ids(0 if name.startswith("base") else max(counts), BATCH), vocab, 8)
    tps = interleaved_decode(engines, cases, vocab, args.reps)
    r["decode"] = summarize(tps, "base engine")
    r["decode_raw"] = tps
    for label, row in r["decode"].items():
        print(
            f"[{shape}] {label}: {row['median']:.0f} tok/s ({row['min']:.0f}-{row['max']:.0f}), "
            f"{row['pct_of_base']:.1f}% of base ({row['pct_min']:.1f}-{row['pct_max']:.1f})",
            flush=True,
        )
    bind(lora)
    r["lora_tps_batch32_32"] = decode_run(lora, distinct_ids(min(32, max(counts)), 32), vocab)
    if dev.type == "cuda":
        r["activation"] = activation_times(adapters, payloads[0])
        print(f"[{shape}] activation {r['activation']}", flush=True)
    del engines, lora
    running.close()
    del adapters, model, payloads
    gc.collect()
    torch.cuda.empty_cache()
    r["peft_tps"] = {}
    peft_cases = ([(32, 32), (64, 64)] if shape == "1b" else [(32, 32)]) if args.peft else []
    for n, batch in peft_cases if dev.type == "cuda" else []:
        r["peft_tps"][f"{n}x{batch}"] = peft_throughput(cfg, n, batch, args.peft_tokens)
        print(
            f"[{shape}] transformers+peft {n} adapters, batch {batch}: {r['peft_tps'][f'{n}x{batch}']:.1f} tok/s",
            flush=True,
        )
        gc.collect()
        torch.cuda.empty_cache()
    results[shape] = r


def table(results: dict) -> str:
    lines = [
        f"{results['gpu']}, {results['date']}: decode tok/s, batch {BATCH}, median of {results['reps']} "
        "interleaved rounds (min-max); % of base = median of per-round ratios",
        "",
        "| shape | case | tok/s | % of base |",
        "|---|---|---:|---:|",
    ]
    for shape, r in results.items():
        if not isinstance(r, dict) or "decode" not in r:
            continue
        for label, row in r["decode"].items():
            lines.append(
                f"| {shape} | {label} | {row['median']:.0f} ({row['min']:.0f}-{row['max']:.0f}) | "
                f"{row['pct_of_base']:.1f} ({row['pct_min']:.1f}-{row['pct_max']:.1f}) |"
            )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--adapters", default="0,1,8,32,64", help="distinct adapters per batch of 64")
    ap.add_argument("--reps", type=int, default=7, help="interleaved rounds over all cases")
    ap.add_argument("--peft", action="store_true", help="also time transformers + peft")
    ap.add_argument(
        "--side-stream", action="store_true", help="also a LoRA engine whose shrink runs beside the base GEMM"
    )
    ap.add_argument(
        "--no-pdl-variants",
        dest="pdl_variants",
        action="store_false",
        help="skip the LoRA engines with programmatic dependent launch flipped (a shorter run)",
    )
    ap.add_argument(
        "--model-pdl-variants",
        action="store_true",
        help="also a base and a LoRA engine whose model kernels (norms, RoPE, attention, activation) "
        "launch without programmatic dependent launch",
    )
    ap.add_argument(
        "--fused-silu-variant",
        action="store_true",
        help="also a LoRA engine whose gate | up expand writes the activation at every step size",
    )
    ap.add_argument(
        "--max-loras",
        type=int,
        default=0,
        help="GPU slots (default: one per adapter); more than the adapters "
        "prices a worker sized for many adapters",
    )
    ap.add_argument("--peft-tokens", type=int, default=8)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    results: dict = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "reps": args.reps,
    }
    for shape in args.shapes.split(","):
        bench_shape(shape, results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
