"""The paged decode attention kernel alone (GPU): µs per launch for Llama-3.2-1B and Llama-3-8B head
shapes over batch sizes and context lengths, 16 launches (a 1B model's layers, each its own KV
cache) captured in one CUDA graph and replayed, rounds interleaved; optionally against another
version of `inference_worker/model/decode_attention.py` given as a file (`--baseline`), in the same
process, with the same inputs, each checked against this tree's output first.

    git show REV:inference_worker/model/decode_attention.py > /tmp/attention_before.py
    python benchmarks/bench_decode_attention.py --baseline /tmp/attention_before.py [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.graph_timing import capture, time_graphs
from loraserve.inference_worker.model import decode_attention

SHAPES = {"1b": (32, 8, 64), "8b": (32, 8, 128)}  # query heads, KV heads, head_dim
LAYERS, BLOCK = 16, 16


def load_version(path: str) -> Callable:
    spec = importlib.util.spec_from_file_location("attention_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.paged_decode_attention


def case(nh: int, nkv: int, d: int, batch: int, ctx: int, width: int) -> tuple:
    """q per layer, caches per layer, block tables [batch, width] and context lengths."""
    blocks_per_seq = -(-ctx // BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    caches = [
        (
            torch.randn(num_blocks, BLOCK, nkv, d, device="cuda", generator=g, dtype=torch.bfloat16),
            torch.randn(num_blocks, BLOCK, nkv, d, device="cuda", generator=g, dtype=torch.bfloat16),
        )
        for _ in range(LAYERS)
    ]
    qs = [torch.randn(batch, nh, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(LAYERS)]
    perm = torch.randperm(num_blocks - 1, device="cuda", generator=g) + 1
    table = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
    table[:, :blocks_per_seq] = perm[: batch * blocks_per_seq].view(batch, blocks_per_seq).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return qs, caches, table, lens


def graph_of(
    fn: Callable, qs: list, caches: list, table: torch.Tensor, lens: torch.Tensor
) -> torch.cuda.CUDAGraph:
    """The attention of every layer's q and caches, one after another, in one graph."""
    scale = qs[0].shape[-1] ** -0.5

    def layers() -> None:
        for q, (k, v) in zip(qs, caches, strict=True):
            fn(q, k, v, table, lens, scale)

    return capture(layers)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--baseline",
        action="append",
        default=[],
        help="another version of decode_attention.py to compare (repeatable; the first is the ratio's baseline)",
    )
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--contexts", default="64,200,600,2000")
    ap.add_argument("--max-model-len", type=int, default=4096, help="the block tables' width, in tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode_attention needs a CUDA GPU", file=sys.stderr)
        return 2
    versions: dict[str, Callable] = {"this tree": decode_attention.paged_decode_attention}
    for i, path in enumerate(args.baseline):
        versions["baseline" if i == 0 else Path(path).stem] = load_version(path)
    width = args.max_model_len // BLOCK
    rows = []
    for shape, (nh, nkv, d) in SHAPES.items():
        for batch in (int(b) for b in args.batches.split(",")):
            for ctx in (int(c) for c in args.contexts.split(",")):
                if ctx > args.max_model_len or batch * ctx > 64 * 2000:  # at most ~8 GB of 8B caches
                    continue
                qs, caches, table, lens = case(nh, nkv, d, batch, ctx, width)
                want = versions["this tree"](qs[0], *caches[0], table, lens, d**-0.5)
                for name, fn in list(versions.items())[1:]:  # the baselines against this tree
                    got = fn(qs[0], *caches[0], table, lens, d**-0.5)
                    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0, msg=name)
                graphs = {name: graph_of(fn, qs, caches, table, lens) for name, fn in versions.items()}
                us = time_graphs(graphs, args.rounds, 20, LAYERS)
                kv_bytes = 2 * batch * ctx * nkv * d * 2
                row = {"shape": shape, "batch": batch, "ctx": ctx, "kv_mb": kv_bytes / 1e6}
                row.update(us)
                rows.append(row)
                line = ", ".join(f"{name} {row[name]:.2f} us" for name in versions)
                print(f"{shape} batch {batch} ctx {ctx} ({row['kv_mb']:.1f} MB of KV): {line}", flush=True)
                del graphs, qs, caches
                torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n{gpu}, {date}: decode attention, µs per layer (medians of {args.rounds} rounds)\n")
    head = " | ".join(versions)
    print(f"| shape | batch | context | KV MB | {head} |" + (" this / baseline |" if args.baseline else ""))
    print("| --- | ---: | ---: | ---: |" + " ---: |" * (len(versions) + bool(args.baseline)))
    for r in rows:
        cells = " | ".join(f"{r[name]:.2f}" for name in versions)
        ratio = f" {r['this tree'] / r['baseline']:.2f} |" if args.baseline else ""
        print(f"| {r['shape']} | {r['batch']} | {r['ctx']} | {r['kv_mb']:.1f} | {cells} |{ratio}")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": gpu, "date": date, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
