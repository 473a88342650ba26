"""The Triton kernel of add_lora_silu_mul (kernels/ops.py): the expand of a gate | up pair that
adds each row's LoRA delta to the base projection and writes silu(gate) * up, every row of the step
visited (those without an adapter get the plain activation). It reads the partials of sgmv.py's
shrink and shares that module's helpers (split_for, sum_partials, load_b, mma).
"""

from __future__ import annotations

import triton
import triton.language as tl

from loraserve.kernels.sgmv import load_b, mma, split_for, sum_partials

# Kernel parameters stay unannotated (type: ignore[no-untyped-def]): Triton reads a parameter's
# annotation as a specialization hint, so a type there would change the compiled kernel.


@triton.jit
def item_or_base_rows(  # type: ignore[no-untyped-def]
    work_slot_ptr,
    work_start_ptr,
    work_end_ptr,
    sorted_rows_ptr,
    ranks_ptr,
    w,
    num_work,
    base_start,
    num_tokens,
    offs_m,
    max_rank,
    BLOCK_M: tl.constexpr,
    I64: tl.constexpr,
):
    """Item w of a kernel that visits every row: w < num_work is work item w (item_rows); past it,
    BLOCK_M rows of those without an adapter (sorted positions base_start..num_tokens), rank 0."""
    is_base = w >= num_work
    wl = tl.where(is_base, 0, w)  # a work list holds at least one entry
    slot = tl.where(is_base, 0, tl.load(work_slot_ptr + wl))
    start = tl.where(is_base, base_start + (w - num_work) * BLOCK_M, tl.load(work_start_ptr + wl))
    end = tl.where(is_base, num_tokens, tl.load(work_end_ptr + wl))
    pos = start + offs_m
    row_ok = pos < end
    rows = tl.load(sorted_rows_ptr + pos, mask=row_ok, other=0)
    if I64:
        rows = rows.to(tl.int64)
        slot = slot.to(tl.int64)
    rank = tl.where(is_base, 0, tl.minimum(tl.load(ranks_ptr + slot), max_rank))
    return slot, rows, row_ok, rank


@triton.jit
def expand_silu_mul_kernel(  # type: ignore[no-untyped-def]
    part_ptr,  # [split, 2, T, R] fp32: the shrink's partials of the gate and up slices
    b_ptr,  # [L, 2I, R]
    ranks_ptr,  # [L] int32
    y_ptr,  # [T, 2I] gate | up of the base projection (read only)
    out_ptr,  # [T, I]
    work_slot_ptr,
    work_start_ptr,
    work_end_ptr,
    work_count_ptr,  # [W], [W], [W], [1] int32
    sorted_rows_ptr,  # [T] int32
    base_start_ptr,  # [1] int32: sorted position of the first row without an adapter
    num_tokens,
    inter,
    max_rank,
    target_items,  # chunks get wider until (items x chunks) is about this
    col_tiles,
    in_features,
    shrink_target,
    max_split,  # the shrink's split_for arguments
    SHRINK_BLOCK_K: tl.constexpr,
    MAX_SPLIT: tl.constexpr,
    MAX_CHUNK_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SINGLE_R: tl.constexpr,
    IEEE: tl.constexpr,
    I64: tl.constexpr,
    B_VEC: tl.constexpr = 1,
    WAIT_PRIOR: tl.constexpr = False,  # launched with PDL after the shrink: wait before reading
):
    # out[t, n] = silu(g) * u, g = y[t, n] + delta_gate, u = y[t, I + n] + delta_up, each rounded
    # to y's dtype first: what the expand's store and then the model's silu_mul kernel compute,
    # in one pass over y and one kernel fewer. Rows without an adapter (or of rank 0) get the plain
    # silu(gate) * up. With WAIT_PRIOR only the work list, ranks and B (written before the shrink
    # started) are read before the wait; s and y after it: y may be the base GEMM's output, which
    # the PDL shrink before this kernel did not wait for.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_work = tl.load(work_count_ptr)
    split, _ = split_for(num_work, col_tiles, in_features, shrink_target, max_split, SHRINK_BLOCK_K)
    base_start = tl.load(base_start_ptr)  # written with the work list, before the shrink started
    num_items = num_work + (num_tokens - base_start + BLOCK_M - 1) // BLOCK_M
    n_tiles = (inter + BLOCK_N - 1) // BLOCK_N
    want = (num_items * n_tiles + target_items - 1) // target_items
    chunk_tiles = tl.maximum(1, tl.minimum(want, MAX_CHUNK_TILES))
    n_chunks = (n_tiles + chunk_tiles - 1) // chunk_tiles
    chunk_n = chunk_tiles * BLOCK_N
    total = num_items * n_chunks
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    part_stride = 2 * num_tokens * max_rank
    two_i = 2 * inter
    for item in range(pid, total, num_programs):
        w = item // n_chunks
        n_lo = (item % n_chunks) * chunk_n
        n_hi = tl.minimum(n_lo + chunk_n, inter)
        slot, rows, row_ok, rank = item_or_base_rows(
            work_slot_ptr,
            work_start_ptr,
            work_end_ptr,
            sorted_rows_ptr,
            ranks_ptr,
            w,
            num_work,
            base_start,
            num_tokens,
            offs_m,
            max_rank,
            BLOCK_M,
            I64,
        )
        b_slot = b_ptr + slot * two_i * max_rank
        sg_base = part_ptr + rows[:, None] * max_rank  # [BM, 1] gate slice
        su_base = part_ptr + (num_tokens + rows[:, None]) * max_rank  # up slice
        y_rows = y_ptr + rows[:, None] * two_i
        o_rows = out_ptr + rows[:, None] * inter
        if SINGLE_R:
            # s stays in registers for the chunk; the first B tiles load before the wait, and
            # each iteration loads the next y tiles before its dots and the next B tiles after
            # its store (the expand's preloading loop, for two slices).
            ns = n_lo + offs_n
            bg = load_b(b_slot, ns, offs_r, ns < n_hi, rank, max_rank, B_VEC)
            bu = load_b(b_slot, inter + ns, offs_r, ns < n_hi, rank, max_rank, B_VEC)
            if WAIT_PRIOR:
                tl.extra.cuda.gdc_wait()
            first = row_ok[:, None] & (ns < n_hi)[None, :]
            g_next = tl.load(y_rows + ns[None, :], mask=first, other=0.0)
            u_next = tl.load(y_rows + inter + ns[None, :], mask=first, other=0.0)
            s_mask = row_ok[:, None] & (offs_r < rank)[None, :]
            sg = sum_partials(sg_base, part_stride, offs_r, s_mask, split, MAX_SPLIT, True)
            su = sum_partials(su_base, part_stride, offs_r, s_mask, split, MAX_SPLIT, True)
            if not IEEE:
                sg = sg.to(b_ptr.dtype.element_ty)
                su = su.to(b_ptr.dtype.element_ty)
            for n0 in range(n_lo, n_hi, BLOCK_N):
                ns = n0 + offs_n
                mask = row_ok[:, None] & (ns < n_hi)[None, :]
                g = g_next
                u = u_next
                ns_next = ns + BLOCK_N
                next_ok = ns_next < n_hi
                next_mask = row_ok[:, None] & next_ok[None, :]
                g_next = tl.load(y_rows + ns_next[None, :], mask=next_mask, other=0.0)
                u_next = tl.load(y_rows + inter + ns_next[None, :], mask=next_mask, other=0.0)
                g = (g.to(tl.float32) + mma(sg, bg, IEEE)).to(g.dtype)
                u = (u.to(tl.float32) + mma(su, bu, IEEE)).to(u.dtype)
                gf = g.to(tl.float32)
                tl.store(o_rows + ns[None, :], (gf / (1.0 + tl.exp(-gf))).to(u.dtype) * u, mask=mask)
                bg = load_b(b_slot, ns_next, offs_r, next_ok, rank, max_rank, B_VEC)
                bu = load_b(b_slot, inter + ns_next, offs_r, next_ok, rank, max_rank, B_VEC)
        else:
            if WAIT_PRIOR:
                tl.extra.cuda.gdc_wait()
            for n0 in range(n_lo, n_hi, BLOCK_N):
                ns = n0 + offs_n
                n_ok = ns < n_hi
                mask = row_ok[:, None] & n_ok[None, :]
                g = tl.load(y_rows + ns[None, :], mask=mask, other=0.0)
                u = tl.load(y_rows + inter + ns[None, :], mask=mask, other=0.0)
                acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for r0 in range(0, rank, BLOCK_R):
                    rs = r0 + offs_r
                    s_mask = row_ok[:, None] & (rs < rank)[None, :]
                    sg = sum_partials(sg_base, part_stride, rs, s_mask, split, MAX_SPLIT, False)
                    bg = load_b(b_slot, ns, rs, n_ok, rank, max_rank, B_VEC)
                    acc_g += mma(sg.to(bg.dtype), bg, IEEE)
                    su = sum_partials(su_base, part_stride, rs, s_mask, split, MAX_SPLIT, False)
                    bu = load_b(b_slot, inter + ns, rs, n_ok, rank, max_rank, B_VEC)
                    acc_u += mma(su.to(bu.dtype), bu, IEEE)
                g = (g.to(tl.float32) + acc_g).to(g.dtype)
                u = (u.to(tl.float32) + acc_u).to(u.dtype)
                gf = g.to(tl.float32)
                tl.store(o_rows + ns[None, :], (gf / (1.0 + tl.exp(-gf))).to(u.dtype) * u, mask=mask)
    if WAIT_PRIOR:
        # every program, also one with no item: the grid completes only after the shrink (and,
        # through its waits, the kernel before it)
        tl.extra.cuda.gdc_wait()
