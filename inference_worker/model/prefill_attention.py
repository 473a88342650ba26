"""Causal attention of all prefill segments of a step in one Triton launch, over the paged KV cache.

Semantics (same as attention.prefill_attention):
    for segment i (query rows query_start[i] .. query_start[i + 1] - 1, q_len_i of them, at
    positions ctx_i - q_len_i .. ctx_i - 1 of their sequence, ctx_i = context_lens[i]),
    query row at position p, head hq (kv head h = hq // group):
        out[row, hq] = softmax(q[row, hq] @ K[i, :p + 1, h].T * scale) @ V[i, :p + 1, h]
    with K[i, n] = k_cache[block_tables[i, n // bs], n % bs]: the cached prefix and this step's
    tokens alike (the layer wrote this step's K/V to the cache before attention runs).

Grid (tiles, num_kv_heads). Each segment is cut into query tiles of TOK tokens; a tile packs the
TOK tokens x the group's query heads (padded to GP, a power of two) into BLOCK_M = TOK * GP rows,
so each K/V block is read once for all query heads that share it. Tiles lie segment after segment;
a program finds its segment by a prefix sum of cdiv(q_len, TOK) over query_start on the device,
and programs past the last tile exit. The grid's tile count is a host-side bound,
cdiv(P, TOK) + S, so nothing is read back to the host. Keys up to the tile's first position are
visible to every row and run unmasked; the tiles across the diagonal run with the causal mask.
Online softmax in fp32 (flash-attention forward), exp2 with log2(e) folded into the scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraserve.inference_worker.model.paged_inputs import paged_inputs

# Kernel parameters stay unannotated (type: ignore[no-untyped-def]): Triton reads a parameter's
# annotation as a specialization hint, so a type there would change the compiled kernel.

BLOCK_M = 64  # query rows (tokens x padded group) per program
SCAN = 64  # segments per step of the tile -> segment scan
LOG2E = 1.4426950408889634


@triton.jit
def _attend_keys(  # type: ignore[no-untyped-def]
    q,
    m,
    lsum,
    acc,
    K,
    V,
    bt_row,
    pos,
    n_lo,
    n_hi,
    qk_scale,
    s_kb,
    s_ks,
    head_off,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
):
    # q: [BLOCK_M, D], pos: [BLOCK_M] query positions; keys n_lo .. n_hi - 1 in BLOCK_N steps
    offs_d = tl.arange(0, D)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < n_hi
        blk = tl.load(bt_row + offs_n // BS, mask=nmask, other=0).to(tl.int64)
        base = blk * s_kb + (offs_n % BS) * s_ks + head_off
        k = tl.load(K + base[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
        if IEEE:  # float32 caches: exact products, not TF32
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s.to(tl.float32) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if CAUSAL:
            s = tl.where(nmask[None, :] & (offs_n[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, 1)
        v = tl.load(V + base[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv.to(tl.float32)
        m = m_new
    return m, lsum, acc


# Per-step metadata (block tables, context lengths, query starts) is sliced out of one packed buffer
# at offsets that change from step to step, and the sequence count and block-table width follow the
# batch: left unspecialized, so serving traffic compiles no new variant (kernel_warmup.py).
@triton.jit(do_not_specialize=["num_seqs", "s_btb"], do_not_specialize_on_alignment=["BT", "CL", "QS"])
def _prefill_kernel(  # type: ignore[no-untyped-def]
    Q,
    K,
    V,
    BT,
    CL,
    QS,
    Out,
    num_seqs,
    qk_scale,
    s_qt,
    s_qh,
    s_kb,
    s_ks,
    s_kh,
    s_btb,
    s_ot,
    s_oh,
    GROUP: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M_: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCAN_: tl.constexpr,
    IEEE: tl.constexpr,
):
    TOK: tl.constexpr = BLOCK_M_ // GP
    tile = tl.program_id(0)
    h = tl.program_id(1)
    # segment of this tile: seq = number of segments whose tiles all lie before it, first = the
    # index of its segment's first tile; total = tiles of the step
    seq = tl.zeros([], tl.int32)
    first = tl.zeros([], tl.int32)
    total = tl.zeros([], tl.int32)
    for c in range(0, num_seqs, SCAN_):
        offs_s = c + tl.arange(0, SCAN_)
        smask = offs_s < num_seqs
        lo = tl.load(QS + offs_s, mask=smask, other=0)
        hi = tl.load(QS + offs_s + 1, mask=smask, other=0)
        ends = total + tl.cumsum((hi - lo + TOK - 1) // TOK, 0)  # [SCAN] tile after each segment
        before = smask & (ends <= tile)
        seq += tl.sum(before.to(tl.int32), 0)
        first = tl.maximum(first, tl.max(tl.where(before, ends, 0), 0))
        total = tl.max(tl.where(smask, ends, total), 0)
    if tile < total:
        q_start = tl.load(QS + seq)
        q_len = tl.load(QS + seq + 1) - q_start
        ctx = tl.load(CL + seq)
        # the last tiles of a segment see the most keys: they get the lowest program ids
        j = tl.cdiv(q_len, TOK) - 1 - (tile - first)
        offs_r = tl.arange(0, BLOCK_M_)
        tok = j * TOK + offs_r // GP  # [BLOCK_M] token within the segment
        g = offs_r % GP  # [BLOCK_M] query head within the group
        rmask = (tok < q_len) & (g < GROUP)
        pos = ctx - q_len + tok  # [BLOCK_M] position in the sequence
        offs_d = tl.arange(0, D)
        q_off = (q_start + tok)[:, None] * s_qt + (h * GROUP + g)[:, None] * s_qh + offs_d[None, :]
        q = tl.load(Q + q_off, mask=rmask[:, None], other=0.0)
        m = tl.full([BLOCK_M_], -1e30, tl.float32)
        lsum = tl.zeros([BLOCK_M_], tl.float32)
        acc = tl.zeros([BLOCK_M_, D], tl.float32)
        bt_row = BT + seq * s_btb
        pos_lo = ctx - q_len + j * TOK  # the tile's first position: keys <= it are seen by all rows
        n_full = (pos_lo + 1) // BLOCK_N * BLOCK_N
        n_end = tl.minimum(pos_lo + TOK, ctx)  # one past the tile's last position
        head_off = h * s_kh
        # the keys every row of the tile sees, unmasked; then those across the diagonal, masked
        for causal in tl.static_range(2):
            m, lsum, acc = _attend_keys(
                q,
                m,
                lsum,
                acc,
                K,
                V,
                bt_row,
                pos,
                n_full if causal else 0,
                n_end if causal else n_full,
                qk_scale,
                s_kb,
                s_ks,
                head_off,
                D=D,
                BS=BS,
                BLOCK_N=BLOCK_N,
                CAUSAL=causal == 1,
                IEEE=IEEE,
            )
        out = acc / lsum[:, None]
        o_off = (q_start + tok)[:, None] * s_ot + (h * GROUP + g)[:, None] * s_oh + offs_d[None, :]
        tl.store(Out + o_off, out.to(Out.dtype.element_ty), mask=rmask[:, None])


def _tile_config(dtype: torch.dtype, d: int, gp: int) -> tuple[int, int, int]:
    """(BLOCK_M query rows, BLOCK_N keys, warps) per program, chosen so that no variant spills on
    sm_90 (tests/inference_worker/model/test_kernels_compile.py)."""
    if dtype == torch.float32:  # exact fp32 products run on FMA units and hold wider operands
        block_m, block_n, num_warps = 32, 16, 8
    else:
        block_m, block_n, num_warps = BLOCK_M, 64, 8 if d > 128 else 4
    return max(block_m, gp), block_n, num_warps


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [P, nh, d] (the S segments back to back), k_cache/v_cache: [num_blocks, bs, nkv, d],
    block_tables: [S, max_blocks] int32, context_lens: [S] int32 (each >= its q_len),
    query_start: [S + 1] int32 on q's device (0 .. P) -> out [P, nh, d] (written into `out`
    when given: any row stride, heads and head_dim packed as q's)."""
    p, _, d = q.shape
    _, bs, nkv, _ = k_cache.shape
    s = block_tables.shape[0]
    assert query_start.dtype == torch.int32 and query_start.shape == (s + 1,) and context_lens.shape == (s,)
    q, block_tables, group, strides = paged_inputs(q, k_cache, v_cache, block_tables, context_lens)
    gp = triton.next_power_of_2(group)
    block_m, block_n, num_warps = _tile_config(q.dtype, d, gp)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    grid = (triton.cdiv(p, block_m // gp) + s, nkv)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start,
        out,
        s,
        scale * LOG2E,
        *strides,
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GP=gp,
        D=d,
        BS=bs,
        BLOCK_M_=block_m,
        BLOCK_N=block_n,
        SCAN_=SCAN,
        IEEE=q.dtype == torch.float32,
        num_warps=num_warps,
    )
    return out
