"""Multi-LoRA kernel benchmark on Llama-3-8B shapes (32 layers x 4 module groups), on one CUDA GPU.

Every configuration (rows T, distinct adapters, ranks) times one whole step of LoRA work —
LoRABatch.prepare plus add_lora for q|k|v, o, gate|up and down of all 32 layers — under a CUDA
graph with a cold L2: a graph of 20 x [zero a 128 MB buffer; step] minus a graph of 20 x [zero].
Each layer has its own A/B slot buffers (slots = the configuration's distinct adapters), so
weights stream from HBM as in a real model.

Columns: time per step; the roofline floor (A and B of every distinct adapter read once at its
true rank — 5.24 MB x rank per adapter — at the measured device-to-device copy bandwidth; the
`+xy` floor adds reading x and reading+writing y of every group); the torch reference (eager,
timed over 4 layers and scaled to 32); one cuBLAS pair per group (x @ A.T, then y_i += s_i @ B_i.T)
when all rows share one adapter.

    python benchmarks/bench_kernels.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loraserve.kernels import LaunchOptions, LoRABatch, add_lora

NUM_LAYERS = 32
HIDDEN, INTERMEDIATE, KV = 4096, 14336, 1024
# (name, in_features, slice widths)
GROUPS = (
    ("qkv", HIDDEN, (HIDDEN, KV, KV)),
    ("o", HIDDEN, (HIDDEN,)),
    ("gate_up", HIDDEN, (INTERMEDIATE, INTERMEDIATE)),
    ("down", INTERMEDIATE, (HIDDEN,)),
)
DTYPE = torch.bfloat16
REPS = 20
L2_FLUSH_BYTES = 128 << 20


@dataclass(frozen=True)
class Config:
    num_tokens: int
    num_adapters: int
    ranks: str  # "8", "16", "64" or "8/64" (half of the adapters each)

    @property
    def label(self) -> str:
        return f"T={self.num_tokens} adapters={self.num_adapters} r={self.ranks}"

    def adapter_ranks(self) -> list[int]:
        if "/" in self.ranks:
            lo, hi = (int(r) for r in self.ranks.split("/"))
            return [lo if i % 2 == 0 else hi for i in range(self.num_adapters)]
        return [int(self.ranks)] * self.num_adapters


CONFIGS = (
    Config(64, 1, "16"),
    Config(64, 8, "16"),
    Config(64, 64, "16"),
    Config(64, 64, "8/64"),
    Config(64, 64, "64"),
    Config(64, 64, "8"),
    Config(64, 8, "64"),
    Config(64, 1, "64"),
    Config(1, 1, "16"),
    Config(16, 16, "16"),
    Config(128, 128, "16"),
    Config(256, 32, "16"),
    Config(512, 8, "16"),
    Config(2048, 1, "16"),
    Config(8192, 1, "16"),
    Config(8192, 1, "64"),
    Config(8192, 16, "16"),
)
QUICK = CONFIGS[:5] + (Config(2048, 1, "16"), Config(8192, 1, "16"))
SWEEP_CONFIGS = (
    Config(64, 1, "16"),
    Config(64, 8, "16"),
    Config(64, 64, "16"),
    Config(64, 64, "8/64"),
    Config(64, 64, "64"),
    Config(2048, 1, "16"),
    Config(8192, 1, "64"),
)
# the decode step at 1 to 64 adapters and the prefill against cuBLAS: the configurations the
# decode-overhead targets name
DECODE_PREFILL = (
    Config(64, 1, "16"),
    Config(64, 8, "16"),
    Config(64, 64, "16"),
    Config(64, 64, "8/64"),
    Config(2048, 1, "16"),
    Config(8192, 1, "16"),
)
TABLES = {"all": CONFIGS, "quick": QUICK, "decode-prefill": DECODE_PREFILL}
# Launch options (kernels.LaunchOptions fields) tried by --sweep, one change from the defaults at a
# time; each variant runs SWEEP_ROUNDS times, interleaved, so the spread between rounds shows noise.
SWEEP_VARIANTS: tuple[dict[str, bool], ...] = (
    {"pdl": False},
    {},
    {"pdl": True, "pdl_shrink": True},
    {"pdl": True, "expand_preload": True},
    {"pdl": True, "expand_preload": False},
)
MORE_VARIANTS: tuple[dict[str, bool], ...] = ({"expand_preload": True}, {"b_vector_loads": False})
SWEEP_ROUNDS = 2
BREAKDOWN_CONFIGS = (Config(64, 1, "16"), Config(64, 64, "16"), Config(64, 64, "64"))


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy, counting bytes read plus written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (1 << 30) / statistics.median(times)


def graph_time(step, flush: torch.Tensor) -> float:
    """Seconds per step: graph of REPS x [flush; step] minus graph of REPS x [flush], median of 5."""

    def capture(with_step: bool) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(REPS):
                flush.zero_()
                if with_step:
                    step()
        return graph

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = [capture(True), capture(False)]
    results = []
    for graph in graphs:
        graph.replay()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        results.append(statistics.median(times))
    del graphs
    return max(0.0, (results[0] - results[1]) / REPS)


class Model:
    """Per-layer, per-group slot buffers of one configuration, and its activations."""

    def __init__(self, config: Config, options: LaunchOptions) -> None:
        self.config, self.options = config, options
        ranks = config.adapter_ranks()
        self.max_rank = max(ranks)
        num_slots = config.num_adapters
        self.rank_t = torch.tensor(ranks, dtype=torch.int32, device="cuda")
        self.layers = []
        for _ in range(NUM_LAYERS):
            layer = []
            for _, din, widths in GROUPS:
                n = sum(widths)
                a = torch.empty(num_slots, len(widths), self.max_rank, din, dtype=DTYPE, device="cuda")
                b = torch.empty(num_slots, n, self.max_rank, dtype=DTYPE, device="cuda")
                a.uniform_(-(din**-0.5), din**-0.5)  # past a slot's rank: left random, never read
                b.uniform_(-0.1, 0.1)
                layer.append((a, b))
            self.layers.append(layer)
        t = config.num_tokens
        self.xs = [torch.randn(t, din, dtype=DTYPE, device="cuda") for _, din, _ in GROUPS]
        self.ys = [torch.randn(t, sum(w), dtype=DTYPE, device="cuda") for _, _, w in GROUPS]
        self.offsets = [[0, *torch.tensor(w).cumsum(0).tolist()] for _, _, w in GROUPS]
        gen = torch.Generator().manual_seed(t * 1000 + num_slots)
        slots = torch.arange(t, dtype=torch.int32) % num_slots
        self.slots = slots[torch.randperm(t, generator=gen)].cuda()
        self.batch = LoRABatch.allocate(t, num_slots, "cuda", max_slices=3, max_rank=self.max_rank)

    def step(self, num_layers: int = NUM_LAYERS, backend: str | None = None) -> None:
        self.batch.prepare(self.slots)
        # a PDL shrink must not follow the kernel that wrote its work list (LaunchOptions.pdl_shrink)
        options = dataclasses.replace(self.options, pdl_shrink=False)
        for layer in self.layers[:num_layers]:
            for (a, b), x, y, offsets in zip(layer, self.xs, self.ys, self.offsets, strict=True):
                add_lora(y, x, a, b, self.rank_t, self.batch, offsets, backend=backend, options=options)
                options = self.options

    def floor_bytes(self) -> tuple[float, float]:
        elem = torch.finfo(DTYPE).bits // 8
        weights = 0
        for r in self.config.adapter_ranks():
            for _, din, widths in GROUPS:
                weights += r * (len(widths) * din + sum(widths)) * elem
        weights *= NUM_LAYERS
        t = self.config.num_tokens
        act = NUM_LAYERS * sum(t * din * elem + 2 * t * sum(w) * elem for _, din, w in GROUPS)
        return float(weights), float(weights + act)

    def cublas_step(self) -> None:
        """One adapter for all rows: s = x @ A[0].T (all slices at once), y_i += s_i @ B[0]_i.T."""
        r = self.max_rank
        for layer in self.layers:
            for (a, b), x, y, offsets, s in zip(
                layer, self.xs, self.ys, self.offsets, self.s_bufs, strict=True
            ):
                torch.mm(x, a[0].view(-1, a.shape[-1]).T, out=s)
                for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
                    y[:, lo:hi].addmm_(s[:, i * r : (i + 1) * r], b[0, lo:hi].T)

    def prepare_cublas(self) -> None:
        t = self.config.num_tokens
        self.s_bufs = [
            torch.empty(t, len(w) * self.max_rank, dtype=DTYPE, device="cuda") for _, _, w in GROUPS
        ]


def eager_time(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def run(
    configs: tuple[Config, ...],
    bandwidth: float,
    with_reference: bool,
    with_cublas: bool = True,
    options: LaunchOptions | None = None,
) -> list[dict]:
    options = options if options is not None else LaunchOptions.for_device("cuda")
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    rows = []
    for config in configs:
        model = Model(config, options)
        t_kernel = graph_time(model.step, flush)
        floor_w, floor_all = model.floor_bytes()
        row = {
            "config": config.label,
            "T": config.num_tokens,
            "adapters": config.num_adapters,
            "ranks": config.ranks,
            "ms": t_kernel * 1e3,
            "floor_ms": floor_w / bandwidth * 1e3,
            "floor_xy_ms": floor_all / bandwidth * 1e3,
        }
        row["x_floor"] = row["ms"] / row["floor_ms"]
        row["x_floor_xy"] = row["ms"] / row["floor_xy_ms"]
        if with_reference:
            t_ref = eager_time(lambda m=model: m.step(num_layers=4, backend="reference"), 1) * NUM_LAYERS / 4
            row["reference_ms"] = t_ref * 1e3
            row["speedup_vs_reference"] = t_ref / t_kernel if t_kernel else float("nan")
        if config.num_adapters == 1 and with_cublas:
            model.prepare_cublas()
            t_cublas = graph_time(model.cublas_step, flush)
            row["cublas_ms"] = t_cublas * 1e3
            row["x_cublas"] = t_kernel / t_cublas if t_cublas else float("nan")
        if not all(torch.isfinite(y).all() for y in model.ys):
            row["error"] = "non-finite output"
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model
        torch.cuda.empty_cache()
    return rows


def sweep(
    bandwidth: float, configs: tuple[Config, ...], variants: tuple[dict[str, bool], ...]
) -> tuple[list[dict], LaunchOptions]:
    """Rows of every variant over `configs`, SWEEP_ROUNDS rounds interleaved, and the options of
    the fastest variant (lowest geometric mean of its per-configuration medians)."""
    results = []
    tried = []
    for variant in variants:
        options = LaunchOptions.for_device("cuda", **variant)
        if any(getattr(options, k) != v for k, v in variant.items()):
            print(f"variant {json.dumps(variant)} is not supported here, skipped")
        else:
            tried.append(variant)
    for round_ in range(SWEEP_ROUNDS):
        for variant in tried:
            options = LaunchOptions.for_device("cuda", **variant)
            for row in run(configs, bandwidth, with_reference=False, with_cublas=False, options=options):
                results.append({"variant": json.dumps(variant), "round": round_, **row})

    def ms_of(variant: dict[str, bool], config: Config) -> list[float]:
        key = json.dumps(variant)
        return [r["ms"] for r in results if r["variant"] == key and r["config"] == config.label]

    def score(variant: dict[str, bool]) -> float:
        return statistics.geometric_mean([statistics.median(ms_of(variant, c)) for c in configs])

    best = min(tried, key=score)
    print(f"kept variant {json.dumps(best)} for the table")
    print("| variant (median of rounds; min-max) | " + " | ".join(c.label for c in configs) + " | geomean |")
    print("|---|" + "---|" * (len(configs) + 1))
    for variant in tried:
        cells = []
        for c in configs:
            ms = ms_of(variant, c)
            cells.append(f"{statistics.median(ms):.3f} ({min(ms):.3f}-{max(ms):.3f})")
        print(f"| {json.dumps(variant)} | " + " | ".join(cells) + f" | {score(variant):.3f} |")
    return results, LaunchOptions.for_device("cuda", **best)


def breakdown(bandwidth: float) -> list[dict]:
    """Per-phase step times (prepare only, shrink launches only, expand launches only), an empty
    Triton kernel's graph cost, and the registers/spills of every compiled kernel variant."""
    import triton

    from loraserve.kernels import triton_ops

    @triton.jit
    def noop_kernel(ptr):
        pass

    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    dummy = torch.zeros(1, device="cuda")
    launches = NUM_LAYERS * len(GROUPS)
    results = [
        {
            "phase": "empty kernel x128",
            "ms": graph_time(lambda: [noop_kernel[(1,)](dummy) for _ in range(launches)], flush) * 1e3,
        }
    ]
    kernels: dict[str, tuple] = {}
    originals = {
        name: getattr(triton_ops, name)
        for name in ("shrink_kernel", "expand_kernel", "_launch_shrink", "_launch_expand")
    }

    class Recorder:
        def __init__(self, name: str, kernel) -> None:
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                compiled = self.kernel[grid](*args, **kwargs)
                consts = {k: v for k, v in kwargs.items() if k.isupper() or k.startswith("num_")}
                kernels[f"{self.name} {consts}"] = (
                    compiled.n_regs,
                    compiled.n_spills,
                    compiled.metadata.shared,
                )
                return compiled

            return launch

    triton_ops.shrink_kernel = Recorder("shrink", originals["shrink_kernel"])
    triton_ops.expand_kernel = Recorder("expand", originals["expand_kernel"])
    try:
        for config in BREAKDOWN_CONFIGS:
            model = Model(config, LaunchOptions.for_device("cuda"))
            results.append(
                {
                    "config": config.label,
                    "phase": "prepare x1",
                    "ms": graph_time(lambda m=model: m.batch.prepare(m.slots), flush) * 1e3,
                }
            )
            for phase, off in (("shrink only", "_launch_expand"), ("expand only", "_launch_shrink")):
                setattr(triton_ops, off, lambda *a, **k: None)
                results.append(
                    {"config": config.label, "phase": phase, "ms": graph_time(model.step, flush) * 1e3}
                )
                setattr(triton_ops, off, originals[off])
            results.append(
                {"config": config.label, "phase": "both", "ms": graph_time(model.step, flush) * 1e3}
            )
            del model
            torch.cuda.empty_cache()
    finally:
        for name, value in originals.items():
            setattr(triton_ops, name, value)
    for r in results:
        print(f"| {r.get('config', '')} | {r['phase']} | {r['ms']:.3f} |")
    for name, (regs, spills, shared) in kernels.items():
        print(f"{name}: regs {regs} spills {spills} smem {shared}")
    return results + [{"kernel": k, "regs_spills_smem": v} for k, v in kernels.items()]


def table(rows: list[dict], gpu: str, bandwidth: float) -> str:
    head = (
        "| T | adapters | rank | LoRA step ms | floor ms (A,B) | x floor | floor ms (+x,y) | x floor+xy "
        "| torch ref ms | speedup | cuBLAS ms | x cuBLAS |"
    )
    lines = [
        f"GPU: {gpu}; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read+write); bf16; "
        f"32 layers x 4 groups; CUDA graph, cold L2",
        "",
        head,
        "|" + "---|" * 12,
    ]

    def f(row: dict, key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else "-"

    for r in rows:
        lines.append(
            f"| {r['T']} | {r['adapters']} | {r['ranks']} | {r['ms']:.3f} | {r['floor_ms']:.3f} | "
            f"{r['x_floor']:.2f} | {r['floor_xy_ms']:.3f} | {r['x_floor_xy']:.2f} | {f(r, 'reference_ms', '.1f')} | "
            f"{f(r, 'speedup_vs_reference', '.0f')} | {f(r, 'cublas_ms', '.3f')} | {f(r, 'x_cublas', '.2f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a subset of the configurations")
    parser.add_argument("--no-reference", action="store_true", help="skip the eager torch reference")
    parser.add_argument("--sweep", action="store_true", help="first try the launch tunables on a few configs")
    parser.add_argument(
        "--all-variants", action="store_true", help="sweep the preload and B-load variants too"
    )
    parser.add_argument(
        "--table-configs", choices=sorted(TABLES), default="all", help="configurations of the table"
    )
    parser.add_argument("--breakdown", action="store_true", help="time prepare/shrink/expand apart")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the full results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    gpu = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.breakdown:
        (out / "kernels_breakdown.json").write_text(json.dumps(breakdown(bandwidth)))
    options = LaunchOptions.for_device("cuda")
    if args.sweep:
        variants = SWEEP_VARIANTS + (MORE_VARIANTS if args.all_variants else ())
        configs = DECODE_PREFILL if args.table_configs == "decode-prefill" else SWEEP_CONFIGS
        swept, options = sweep(bandwidth, configs, variants)
        (out / "kernels_sweep.json").write_text(json.dumps(swept))
    table_configs = QUICK if args.quick else TABLES[args.table_configs]
    rows = run(table_configs, bandwidth, not args.no_reference, options=options)
    text = table(rows, gpu, bandwidth)
    (out / "kernels_bench.md").write_text(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n{text}\n")
    (out / "kernels_bench.json").write_text(
        json.dumps({"gpu": gpu, "bandwidth": bandwidth, "options": dataclasses.asdict(options), "rows": rows})
    )
    print(f"launch options of the table: {dataclasses.asdict(options)}")
    print(text)


if __name__ == "__main__":
    main()
