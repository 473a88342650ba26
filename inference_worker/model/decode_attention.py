"""Paged decode attention as a Triton kernel (split over the context, then a reduction).

Semantics (same as attention.decode_attention_reference):
    for b, head hq (kv head h = hq // group):
        out[b, hq] = softmax(q[b, hq] @ K[b, :len_b, h].T * scale) @ V[b, :len_b, h]
    with K[b, p] = k_cache[block_tables[b, p // bs], p % bs].

Pass 1, grid (B, num_kv_heads, max_parts): each (sequence, KV head)'s context is split in parts of
whole tiles, chosen on the device from its length: as many as give the device about two programs
per multiprocessor (at most MAX_MERGE, at most its tiles), and at least as many as keep each within
PART tokens. Each program covers one part for all query heads of one KV head (rows padded to >= 16
for tl.dot), keeping the running max, sum and weighted values (online softmax). A context of one
part is written as the output there and then; a longer one's parts go to fp32 scratch (the rows
that are heads). Programs past the context exit at once. Pass 2, grid (B, num_kv_heads), merges
the parts of the contexts of more than one part (the others' programs exit at once). Context
lengths are read on the device, so one launch shape serves every step (CUDA-graph friendly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraserve.inference_worker.model.launch import pdl_launch
from loraserve.inference_worker.model.paged_inputs import paged_inputs
from loraserve.kernels.launch_options import multiprocessors

# Kernel parameters stay unannotated (type: ignore[no-untyped-def]): Triton reads a parameter's
# annotation as a specialization hint, so a type there would change the compiled kernel.

PART = 512  # the most context tokens one program covers
TILE = 64  # context tokens a program reads at a time
MAX_MERGE = tl.constexpr(16)  # the most parts a context is split in beyond what PART asks for


def parts_wanted(programs_per_part: int, device: torch.device) -> int:
    """Parts each (sequence, KV head)'s context is split in so that the device has about two
    programs per multiprocessor; 1 once the batch alone gives it that many (batch 64 of the 1B and
    8B shapes on an H200). With 1 the kernels are compiled without the split (SPLIT): its
    arithmetic alone measured up to 2.4 µs a layer slower at batch 64 and 256 with 64-token
    contexts, where it splits nothing."""
    return max(1, -(-2 * multiprocessors(device) // programs_per_part))


@triton.jit
def _parts_of(ctx, WANT, PART_: tl.constexpr, TILE_: tl.constexpr, SPLIT: tl.constexpr):  # type: ignore[no-untyped-def]
    """(tokens per part, parts) of a context of ctx tokens: with SPLIT, WANT parts, or as many whole
    tiles as the context has, at most MAX_MERGE, and at least as many as keep a part within PART_
    tokens, each a whole number of tiles; without (one part wanted), parts of PART_ tokens."""
    if not SPLIT:
        return PART_, tl.cdiv(ctx, PART_)
    parts = tl.maximum(tl.minimum(tl.minimum(WANT, tl.cdiv(ctx, TILE_)), MAX_MERGE), tl.cdiv(ctx, PART_))
    length = tl.cdiv(tl.cdiv(ctx, parts), TILE_) * TILE_
    return length, tl.cdiv(ctx, length)


# The per-step metadata (block tables, context lengths) is sliced out of one packed buffer at offsets
# that change from step to step, and the block-table width follows the longest context: left
# unspecialized (scalar loads either way), so these never compile a new variant under traffic.
@triton.jit(do_not_specialize=["s_btb", "WANT"], do_not_specialize_on_alignment=["BT", "CL"])
def _decode_part_kernel(  # type: ignore[no-untyped-def]
    Q,
    K,
    V,
    BT,
    CL,
    M,
    L,
    ACC,
    Out,
    scale,
    WANT,
    s_qb,
    s_qh,
    s_kb,
    s_ks,
    s_kh,
    s_btb,
    s_mb,
    s_mh,
    s_mp,
    s_ob,
    s_oh,
    GROUP: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    PART_: tl.constexpr,
    TILE_: tl.constexpr,
    IEEE: tl.constexpr,
    SPLIT: tl.constexpr,
    WAIT_PRIOR: tl.constexpr = False,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)
    if WAIT_PRIOR:  # launched with PDL (model/launch.py): q comes from the kernel before
        tl.extra.cuda.gdc_wait()
    ctx = tl.load(CL + b)
    length, num_parts = _parts_of(ctx, WANT, PART_, TILE_, SPLIT)
    start = part * length
    if start < ctx:
        end = tl.minimum(start + length, ctx)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        gmask = offs_g < GROUP
        q = tl.load(
            Q + b * s_qb + (h * GROUP + offs_g)[:, None] * s_qh + offs_d[None, :],
            mask=gmask[:, None],
            other=0.0,
        )
        m = tl.full([GP], -1e30, tl.float32)
        lsum = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for t0 in range(start, end, TILE_):
            offs_t = t0 + tl.arange(0, TILE_)
            tmask = offs_t < end
            blk = tl.load(BT + b * s_btb + offs_t // BS, mask=tmask, other=0).to(tl.int64)
            base = blk * s_kb + (offs_t % BS) * s_ks + h * s_kh
            k = tl.load(K + base[:, None] + offs_d[None, :], mask=tmask[:, None], other=0.0)
            if IEEE:  # float32 caches: exact products, not TF32
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s.to(tl.float32) * scale  # [GP, TILE]
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            lsum = lsum * alpha + tl.sum(p, 1)
            v = tl.load(V + base[:, None] + offs_d[None, :], mask=tmask[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv.to(tl.float32)
            m = m_new
        if num_parts == 1:  # the whole context in this program: its output, no pass 2
            out_at = Out + b * s_ob + (h * GROUP + offs_g)[:, None] * s_oh + offs_d[None, :]
            tl.store(out_at, (acc / lsum[:, None]).to(Out.dtype.element_ty), mask=gmask[:, None])
        else:
            mo = b * s_mb + h * s_mh + part * s_mp + offs_g
            tl.store(M + mo, m, mask=gmask)
            tl.store(L + mo, lsum, mask=gmask)
            tl.store(ACC + mo[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])


@triton.jit(do_not_specialize=["WANT"], do_not_specialize_on_alignment=["CL"])
def _decode_reduce_kernel(  # type: ignore[no-untyped-def]
    M,
    L,
    ACC,
    CL,
    WANT,
    Out,
    s_mb,
    s_mh,
    s_mp,
    s_ob,
    s_oh,
    GROUP: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    PART_: tl.constexpr,
    TILE_: tl.constexpr,
    SPLIT: tl.constexpr,
    WAIT_PRIOR: tl.constexpr = False,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    if WAIT_PRIOR:  # launched with PDL (model/launch.py): the parts come from the kernel before
        tl.extra.cuda.gdc_wait()
    ctx = tl.load(CL + b)
    _, num_parts = _parts_of(ctx, WANT, PART_, TILE_, SPLIT)
    if num_parts == 1:  # pass 1 wrote this output
        return
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    gmask = offs_g < GROUP
    m = tl.full([GP], -1e30, tl.float32)
    lsum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for part in range(0, num_parts):
        mo = b * s_mb + h * s_mh + part * s_mp + offs_g
        mp = tl.load(M + mo, mask=gmask, other=-1e30)
        lp = tl.load(L + mo, mask=gmask, other=1.0)
        ap = tl.load(ACC + mo[:, None] * D + offs_d[None, :], mask=gmask[:, None], other=0.0)
        m_new = tl.maximum(m, mp)
        a_old = tl.exp(m - m_new)
        a_new = tl.exp(mp - m_new)
        lsum = lsum * a_old + lp * a_new
        acc = acc * a_old[:, None] + ap * a_new[:, None]
        m = m_new
    out = acc / lsum[:, None]
    tl.store(
        Out + b * s_ob + (h * GROUP + offs_g)[:, None] * s_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=gmask[:, None],
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, nh, d], k_cache/v_cache: [num_blocks, bs, nkv, d], block_tables: [B, max_blocks] int32,
    context_lens: [B] int32 (each >= 1) -> out [B, nh, d]."""
    b, _, d = q.shape
    _, bs, nkv, _ = k_cache.shape
    q, block_tables, group, strides = paged_inputs(q, k_cache, v_cache, block_tables, context_lens)
    gp = max(16, triton.next_power_of_2(group))
    want = parts_wanted(b * nkv, q.device)
    longest = block_tables.shape[1] * bs  # the grid covers the most parts any context can take
    max_parts = max(min(want, triton.cdiv(longest, TILE), MAX_MERGE.value), triton.cdiv(longest, PART))
    m = torch.empty((b, nkv, max_parts, gp), dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    acc = torch.empty((b, nkv, max_parts, gp, d), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    _decode_part_kernel[(b, nkv, max_parts)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        m,
        lsum,
        acc,
        out,
        scale,
        want,
        *strides,
        m.stride(0),
        m.stride(1),
        m.stride(2),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GP=gp,
        D=d,
        BS=bs,
        PART_=PART,
        TILE_=TILE,
        IEEE=q.dtype == torch.float32,
        SPLIT=want > 1,
        num_warps=4,
        **pdl_launch(q.device),
    )
    _decode_reduce_kernel[(b, nkv)](
        m,
        lsum,
        acc,
        context_lens,
        want,
        out,
        m.stride(0),
        m.stride(1),
        m.stride(2),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GP=gp,
        D=d,
        PART_=PART,
        TILE_=TILE,
        SPLIT=want > 1,
        num_warps=4,
        **pdl_launch(q.device),
    )
    return out
