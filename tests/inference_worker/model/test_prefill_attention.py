"""The Triton paged-prefill attention kernel against the per-segment SDPA reference
(attention.prefill_attention, in float64): several segments of different lengths in one launch,
with and without a cached prefix, GQA and plain multi-head. On CUDA over dtypes and Llama shapes,
and through Triton's interpreter on CPU (float32 and float16, tiny grids, in a subprocess so the
interpreter setting does not leak into other tests)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.interpreter import interpreted

CASE = r"""
import torch
from loraserve.inference_worker.model.attention import prefill_attention
from loraserve.inference_worker.model.forward_batch import ForwardBatch
from loraserve.inference_worker.model.prefill_attention import paged_prefill_attention

def check(device, dtype, nh, nkv, d, bs, segs, atol):
    # segs: (q_len, context_len) per prefill segment; q_len < context_len: a cached prefix
    g = torch.Generator(device="cpu").manual_seed(0)
    num_blocks = 1 + sum((c + bs - 1) // bs for _, c in segs) + 3
    k_cache = torch.randn(num_blocks, bs, nkv, d, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, bs, nkv, d, generator=g).to(device, dtype)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    width = max((c + bs - 1) // bs for _, c in segs) + 2
    table = torch.zeros(len(segs), width, dtype=torch.int32)
    qs, slots = [0], []
    for i, (n, c) in enumerate(segs):
        nb = (c + bs - 1) // bs
        table[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        slots += [int(table[i, p // bs]) * bs + p % bs for p in range(c - n, c)]
        qs.append(qs[-1] + n)
    q = torch.randn(qs[-1], nh, d, generator=g).to(device, dtype)
    # this step's K/V: what the layer wrote to the cache before attention
    k = k_cache.view(-1, nkv, d)[slots]
    v = v_cache.view(-1, nkv, d)[slots]
    table = table.to(device)
    cl = torch.tensor([c for _, c in segs], dtype=torch.int32, device=device)
    qs_dev = torch.tensor(qs, dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))  # rows the kernel leaves unwritten fail the comparison
    paged_prefill_attention(q, k_cache, v_cache, table, cl, qs_dev, d ** -0.5, out=out)
    zeros = torch.zeros(qs[-1], dtype=torch.int64)
    batch = ForwardBatch(
        input_ids=zeros, positions=zeros, slot_mapping=zeros, block_tables=table.cpu(),
        context_lens=cl.cpu(), logits_indices=zeros, token_slots=zeros.int(),
        num_prefills=len(segs), num_prefill_tokens=qs[-1], query_start=qs,
        context_lens_cpu=[c for _, c in segs],
    )
    f64 = lambda t: t.cpu().double()
    ref = prefill_attention(
        f64(q), f64(k), f64(v), f64(k_cache), f64(v_cache), batch, d ** -0.5
    )
    torch.testing.assert_close(f64(out), ref, atol=atol, rtol=0)

# no prefix; prefixes ending inside a block, on a block edge and one key short of a 64-key tile
# (the first row of the diagonal tile sees none of its keys); a segment spanning query tiles
SEGS = [(5, 5), (17, 17), (1, 1), (20, 45), (3, 64), (10, 73), (70, 100), (1, 30)]
# a step padded to a graph's shape: segments of no tokens among and after the others (decode rows
# are one-token segments with a cached prefix)
PADDED = [(0, 1), (7, 7), (1, 40), (0, 1), (1, 17), (12, 30), (0, 1), (0, 1)]
"""


def run_interpreted(body: str) -> None:
    assert "ok" in interpreted(CASE + body + "\nprint('ok')\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test covers the kernel")
def test_kernel_in_triton_interpreter() -> None:
    pytest.importorskip("triton")
    run_interpreted(
        # GQA (4 query heads per KV head) and plain multi-head, float32 and float16
        "check('cpu', torch.float32, 4, 1, 16, 16, SEGS, 1e-5)\n"
        "check('cpu', torch.float32, 2, 2, 32, 16, SEGS, 1e-5)\n"
        "check('cpu', torch.float16, 8, 2, 16, 16, SEGS, 4e-3)\n"
        # more segments than one step of the tile -> segment scan (64)
        "check('cpu', torch.float32, 4, 1, 16, 16, [(1 + i % 3, 1 + i % 3 + i % 5) for i in range(70)], 1e-5)\n"
        "check('cpu', torch.float32, 4, 1, 16, 16, PADDED, 1e-5)\n"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "dtype, atol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3), (torch.float32, 1e-4)]
)
@pytest.mark.parametrize(
    "nh, nkv, d, bs", [(32, 8, 64, 16), (32, 8, 128, 16), (14, 2, 64, 32), (8, 8, 128, 16), (9, 3, 64, 16)]
)
def test_kernel_on_cuda(dtype, atol, nh, nkv, d, bs) -> None:
    ns: dict = {}
    exec(CASE, ns)
    segs = ns["SEGS"] + [(1, 1500), (300, 300), (513, 1000), (128, 128), (37, 600)]
    ns["check"]("cuda", dtype, nh, nkv, d, bs, segs, atol)
    ns["check"]("cuda", dtype, nh, nkv, d, bs, [(1 + i % 7, 1 + i % 7 + 3 * i) for i in range(200)], atol)
    ns["check"]("cuda", dtype, nh, nkv, d, bs, ns["PADDED"] * 5, atol)
