"""Prefill attention of one layer on CUDA: the per-segment SDPA loop (attention.prefill_attention)
against the one-launch Triton kernel (prefill_attention.paged_prefill_attention), on steps shaped
like serving load (many short prompts; chunks with a cached prefix; one long prompt).

    python3 benchmarks/bench_prefill_attention.py [--shape 1b|8b] [--sweep]

Times are per layer call, wall clock over back-to-back calls (host launch overhead included: the
SDPA loop is bound by it). --sweep also times the kernel's tile configurations.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.bench_kernels import eager_time
from loraserve.inference_worker.model import prefill_attention as pa
from loraserve.inference_worker.model.attention import prefill_attention
from loraserve.inference_worker.model.forward_batch import ForwardBatch

SHAPES = {"1b": (32, 8, 64), "8b": (32, 8, 128)}  # (heads, kv heads, head_dim)
BS = 16
ITERS = 30  # back-to-back calls timed per measurement


def workloads() -> dict[str, list[tuple[int, int]]]:
    """Name -> (q_len, context_len) per prefill segment."""
    rng = random.Random(0)
    short = [(n, n) for n in (rng.randint(20, 300) for _ in range(24))]
    chunked = [(q, q + rng.randint(0, 2000)) for q in (rng.randint(16, 256) for _ in range(24))]
    return {"24 prompts 20-300": short, "24 chunks + prefix": chunked, "1 prompt 4096": [(4096, 4096)]}


def make_step(segs: list[tuple[int, int]], nh: int, nkv: int, d: int, dtype: torch.dtype):
    dev = torch.device("cuda")
    num_blocks = 1 + sum((c + BS - 1) // BS for _, c in segs)
    k_cache = torch.randn(num_blocks, BS, nkv, d, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    width = max((c + BS - 1) // BS for _, c in segs)
    table = torch.zeros(len(segs), width, dtype=torch.int32)
    qs, slots, nxt = [0], [], 1
    for i, (n, c) in enumerate(segs):
        nb = (c + BS - 1) // BS
        table[i, :nb] = torch.arange(nxt, nxt + nb, dtype=torch.int32)
        nxt += nb
        slots += [int(table[i, p // BS]) * BS + p % BS for p in range(c - n, c)]
        qs.append(qs[-1] + n)
    q = torch.randn(qs[-1], nh, d, device=dev, dtype=dtype)
    idx = torch.tensor(slots, device=dev)
    k, v = k_cache.view(-1, nkv, d)[idx], v_cache.view(-1, nkv, d)[idx]
    zeros = torch.zeros(qs[-1], dtype=torch.int64, device=dev)
    batch = ForwardBatch(
        input_ids=zeros,
        positions=zeros,
        slot_mapping=zeros,
        block_tables=table.to(dev),
        context_lens=torch.tensor([c for _, c in segs], dtype=torch.int32, device=dev),
        logits_indices=zeros,
        token_slots=zeros.int(),
        num_prefills=len(segs),
        num_prefill_tokens=qs[-1],
        query_start=qs,
        context_lens_cpu=[c for _, c in segs],
        prefill_query_start=torch.tensor(qs, dtype=torch.int32, device=dev),
    )
    return q, k, v, k_cache, v_cache, batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="1b")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    nh, nkv, d = SHAPES[args.shape]
    dtype = torch.bfloat16
    scale = d**-0.5
    default = pa._tile_config
    configs = [None]
    if args.sweep:
        configs += [(64, 32, 4), (128, 64, 8), (128, 32, 8), (64, 64, 8)]
    print(f"shape {args.shape}: heads {nh}, kv heads {nkv}, head_dim {d}, bf16, block {BS}")
    for name, segs in workloads().items():
        q, k, v, kc, vc, batch = make_step(segs, nh, nkv, d, dtype)
        ref = prefill_attention(q, k, v, kc, vc, batch, scale)
        sdpa = eager_time(lambda: prefill_attention(q, k, v, kc, vc, batch, scale), ITERS) * 1e6  # noqa: B023
        row = f"{name:22s} tokens {q.shape[0]:5d}  sdpa loop {sdpa:8.0f} us"
        for cfg in configs:
            pa._tile_config = default if cfg is None else (lambda *_, c=cfg: (max(c[0], _[2]), c[1], c[2]))
            args_ = (q, kc, vc, batch.block_tables, batch.context_lens, batch.prefill_query_start, scale)
            out = pa.paged_prefill_attention(*args_)
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            t = eager_time(lambda a=args_: pa.paged_prefill_attention(*a), ITERS) * 1e6
            row += f"  triton{'' if cfg is None else cfg} {t:7.0f} us (rel err {err:.1e})"
        pa._tile_config = default
        print(row, flush=True)


if __name__ == "__main__":
    main()
