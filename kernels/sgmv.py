"""Triton kernels of the grouped LoRA matmuls (SGMV-style: rows grouped by adapter slot).

Both kernels walk a work list built by LoRABatch.prepare: item w = (slot, sorted rows
[start, min(start + BLOCK_M, end))). The grid is a fixed number of programs that loop over
(work item x tile) indices up to the item count read on the device, so a captured CUDA graph
stays valid for any slot assignment and idle programs cost nothing.

shrink:  part[kc, i, t, r] = sum_{k in chunk kc} x[t, k] * A[slot, i, r, k]    (r < rank[slot])
expand:  y[t, o_i + n] += sum_r (sum_kc part[kc, i, t, r]) * B[slot, o_i + n, r]

The number of K chunks (split-K partials) is picked on the device from the number of work items
(`split_for`), the same way in both kernels: many chunks when few adapters would leave the
machine idle, one when the adapters alone fill it. Entries of A and B past a slot's rank are
masked out of every load (no traffic, and garbage there never reaches the result).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Kernel parameters stay unannotated (type: ignore[no-untyped-def]): Triton reads a parameter's
# annotation as a specialization hint, so a type there would change the compiled kernel.


@triton.jit
def split_for(num_work, col_tiles, in_features, target_items, max_split, BLOCK_K: tl.constexpr):  # type: ignore[no-untyped-def]
    """K chunks per (work item, column tile) and their width (a multiple of BLOCK_K)."""
    want = tl.maximum(1, tl.minimum(target_items // tl.maximum(num_work * col_tiles, 1), max_split))
    k_blocks = (in_features + BLOCK_K - 1) // BLOCK_K
    k_chunk = ((k_blocks + want - 1) // want) * BLOCK_K
    return (in_features + k_chunk - 1) // k_chunk, k_chunk


@triton.jit
def item_rows(  # type: ignore[no-untyped-def]
    work_slot_ptr,
    work_start_ptr,
    work_end_ptr,
    sorted_rows_ptr,
    ranks_ptr,
    w,
    offs_m,
    max_rank,
    I64: tl.constexpr,
):
    """Work item w: its slot, row ids (masked past the item's end) and the slot's rank."""
    slot = tl.load(work_slot_ptr + w)
    start = tl.load(work_start_ptr + w)
    end = tl.load(work_end_ptr + w)
    pos = start + offs_m
    row_ok = pos < end
    rows = tl.load(sorted_rows_ptr + pos, mask=row_ok, other=0)
    if I64:  # offsets past 2**31 elements
        rows = rows.to(tl.int64)
        slot = slot.to(tl.int64)
    rank = tl.minimum(tl.load(ranks_ptr + slot), max_rank)
    return slot, rows, row_ok, rank


@triton.jit
def sum_partials(s_base, part_stride, rs, s_mask, split, MAX_SPLIT: tl.constexpr, UNROLL: tl.constexpr):  # type: ignore[no-untyped-def]
    """s of one row tile: the sum of the shrink's `split` K-chunk partials (fp32). UNROLL issues all
    MAX_SPLIT (masked) loads at once; otherwise a run-time loop keeps one partial in registers at a
    time (wide rank tiles, which would spill)."""
    st = tl.zeros(s_mask.shape, dtype=tl.float32)
    if UNROLL:
        for kc in tl.static_range(MAX_SPLIT):
            st += tl.load(
                s_base + kc * part_stride + rs[None, :],
                mask=s_mask & (rs[None, :] * 0 + kc < split),
                other=0.0,
            )
    else:
        for kc in range(0, split):
            st += tl.load(s_base + kc * part_stride + rs[None, :], mask=s_mask, other=0.0)
    return st


@triton.jit
def load_b(b_slot, ns, rs, n_ok, rank, max_rank, VEC: tl.constexpr):  # type: ignore[no-untyped-def]
    """B tile [R, N] of one slot: B[n, r] for r < rank, zero past it. A row of B is contiguous
    along r, so the load mask covers whole VEC-element vectors (16-byte loads; VEC divides
    max_rank, so no vector leaves the row) and the entries from the rank to the vector's end are
    zeroed in registers: whatever is stored there never reaches the dot."""
    v_ok = (rs // VEC) < ((rank + VEC - 1) // VEC)
    bt = tl.load(b_slot + ns[None, :] * max_rank + rs[:, None], mask=v_ok[:, None] & n_ok[None, :], other=0.0)
    if VEC > 1:
        bt = tl.where((rs < rank)[:, None], bt, 0.0)
    return bt


@triton.jit
def mma(a, b, IEEE: tl.constexpr):  # type: ignore[no-untyped-def]
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def shrink_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # [T, K]
    a_ptr,  # [L, S, R, K]
    ranks_ptr,  # [L] int32
    part_ptr,  # [split, S, T, R] fp32
    work_slot_ptr,
    work_start_ptr,
    work_end_ptr,
    work_count_ptr,  # [W], [W], [W], [1] int32
    sorted_rows_ptr,  # [T] int32
    num_tokens,
    in_features,
    max_rank,
    num_slices,
    col_tiles,  # column tiles per work item
    col_tiles_per_slice,  # SLICE_ALIGNED: column tiles of one slice
    target_items,
    max_split,  # split_for arguments
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SLICE_ALIGNED: tl.constexpr,  # tiles within one slice (skippable past the rank) or over S*R
    IEEE: tl.constexpr,
    I64: tl.constexpr,  # some tensor has 2**31 elements or more: 64-bit offsets
    LAUNCH_DEPENDENTS: tl.constexpr = False,  # let a PDL-launched expand start its prologue now
    WAIT_PRIOR: tl.constexpr = False,  # itself launched with PDL: wait for the prior kernel to store
):
    # With WAIT_PRIOR this kernel may start while the kernel before it (the base projection's GEMM,
    # or the previous group's expand) still runs. What it reads (x, A, ranks, work list) was written
    # before that kernel started; what it writes (the partials) may still be read by it, so every
    # program waits before its first store, and at its end: the grid completes only after the prior
    # kernel has, so a kernel that waits for this one (the PDL expand) sees the prior's stores too.
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_work = tl.load(work_count_ptr)
    split, k_chunk = split_for(num_work, col_tiles, in_features, target_items, max_split, BLOCK_K)
    items_per_work = col_tiles * split
    total = num_work * items_per_work
    offs_m = tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, BLOCK_C)
    offs_k = tl.arange(0, BLOCK_K)
    for item in range(pid, total, num_programs):
        w = item // items_per_work
        rem = item % items_per_work
        ct = rem // split
        kc = rem % split
        slot, rows, row_ok, rank = item_rows(
            work_slot_ptr, work_start_ptr, work_end_ptr, sorted_rows_ptr, ranks_ptr, w, offs_m, max_rank, I64
        )
        if SLICE_ALIGNED:
            sl = ct // col_tiles_per_slice + offs_c * 0
            first_r = (ct % col_tiles_per_slice) * BLOCK_C
            rr = first_r + offs_c
        else:
            cols = ct * BLOCK_C + offs_c
            sl = cols // max_rank
            rr = cols % max_rank
            first_r = 0
        col_ok = (sl < num_slices) & (rr < rank)
        if first_r < rank:
            a_rows = (slot * num_slices + sl) * max_rank + rr  # [BC] rows of A
            x_base = x_ptr + rows[:, None] * in_features  # [BM, 1]
            a_base = a_ptr + a_rows[None, :] * in_features  # [1, BC]
            k_lo = kc * k_chunk
            k_hi = tl.minimum(k_lo + k_chunk, in_features)
            acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
            for k in range(k_lo, k_hi, BLOCK_K):
                ks = k + offs_k
                k_ok = ks < k_hi
                xt = tl.load(x_base + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                at = tl.load(a_base + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc += mma(xt, at, IEEE)
            out = (
                part_ptr
                + ((kc * num_slices + sl[None, :]) * num_tokens + rows[:, None]) * max_rank
                + rr[None, :]
            )
            if WAIT_PRIOR:
                tl.extra.cuda.gdc_wait()
            tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])
    if WAIT_PRIOR:
        tl.extra.cuda.gdc_wait()


@triton.jit
def expand_kernel(  # type: ignore[no-untyped-def]
    part_ptr,  # [split, S, T, R] fp32
    b_ptr,  # [L, N, R]
    ranks_ptr,  # [L] int32
    y_ptr,  # [T, N]
    work_slot_ptr,
    work_start_ptr,
    work_end_ptr,
    work_count_ptr,  # [W], [W], [W], [1] int32
    sorted_rows_ptr,  # [T] int32
    num_tokens,
    out_features,
    max_rank,
    num_slices,
    o1,
    o2,
    o3,  # slice offsets into N (past the last slice: out_features)
    n0_tiles,
    n1_tiles,
    n2_tiles,
    n3_tiles,  # BLOCK_N tiles of each slice (0 past the last)
    target_items,  # chunks get wider until (work items x chunks) is about this
    col_tiles,
    in_features,
    shrink_target,
    max_split,  # the shrink's split_for arguments
    SHRINK_BLOCK_K: tl.constexpr,
    MAX_SPLIT: tl.constexpr,  # >= any split the shrink picked
    MAX_CHUNK_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SINGLE_R: tl.constexpr,  # max_rank <= BLOCK_R: s is loaded once per item
    IEEE: tl.constexpr,
    I64: tl.constexpr,  # some tensor has 2**31 elements or more: 64-bit offsets
    B_VEC: tl.constexpr = 1,  # elements per B load vector along the rank (1: exact rank mask)
    PRELOAD: tl.constexpr = False,  # SINGLE_R: load an item's first B and y tiles before its s
    WAIT_PRIOR: tl.constexpr = False,  # launched with PDL after the shrink: wait before reading s
    Y_READY: tl.constexpr = True,  # y was stored before the shrink started (else: read after the wait)
    LAUNCH_DEPENDENTS: tl.constexpr = False,  # let a PDL-launched shrink that follows start now
):
    # With WAIT_PRIOR, everything this kernel reads before gdc_wait (work list, ranks, B and, with
    # Y_READY, y) was written before the shrink started; only the shrink's partials need the wait.
    # A shrink launched with PDL itself may start before y's producer (the base GEMM) ends: then y
    # is read only after the wait, which returns once the shrink, and so that producer, completed.
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_work = tl.load(work_count_ptr)
    split, _ = split_for(num_work, col_tiles, in_features, shrink_target, max_split, SHRINK_BLOCK_K)
    # An item is a chunk of chunk_tiles output tiles of one slice for one work item; chunks widen
    # when many work items already fill the machine, so each item streams a long run of B.
    n_tiles = n0_tiles + n1_tiles + n2_tiles + n3_tiles
    want = (num_work * n_tiles + target_items - 1) // target_items
    chunk_tiles = tl.maximum(1, tl.minimum(want, MAX_CHUNK_TILES))
    t1 = (n0_tiles + chunk_tiles - 1) // chunk_tiles
    t2 = t1 + (n1_tiles + chunk_tiles - 1) // chunk_tiles
    t3 = t2 + (n2_tiles + chunk_tiles - 1) // chunk_tiles
    n_chunks = t3 + (n3_tiles + chunk_tiles - 1) // chunk_tiles
    chunk_n = chunk_tiles * BLOCK_N
    total = num_work * n_chunks
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    part_stride = num_slices * num_tokens * max_rank
    for item in range(pid, total, num_programs):
        w = item // n_chunks
        j = item % n_chunks
        sl = (j >= t1).to(tl.int32) + (j >= t2).to(tl.int32) + (j >= t3).to(tl.int32)
        lo = tl.where(sl == 0, 0, tl.where(sl == 1, o1, tl.where(sl == 2, o2, o3)))
        hi = tl.where(sl == 0, o1, tl.where(sl == 1, o2, tl.where(sl == 2, o3, out_features)))
        first_chunk = tl.where(sl == 0, 0, tl.where(sl == 1, t1, tl.where(sl == 2, t2, t3)))
        n_lo = lo + (j - first_chunk) * chunk_n
        n_hi = tl.minimum(n_lo + chunk_n, hi)
        slot, rows, row_ok, rank = item_rows(
            work_slot_ptr, work_start_ptr, work_end_ptr, sorted_rows_ptr, ranks_ptr, w, offs_m, max_rank, I64
        )
        b_slot = b_ptr + slot * out_features * max_rank
        s_base = part_ptr + (sl * num_tokens + rows[:, None]) * max_rank  # [BM, 1]
        y_rows = y_ptr + rows[:, None] * out_features  # [BM, 1]
        if rank > 0:
            if SINGLE_R:
                # s stays in registers for the whole chunk. y of the next tile is loaded before the
                # current tile's dot (manual prefetch). B: with PRELOAD the item's first tile is
                # loaded before s (before the PDL wait) and each iteration loads the next tile after
                # its store; otherwise each iteration loads its own (prefetching B as well measured
                # slower: registers). Either way one B tile is live at a time.
                r_ok = offs_r < rank
                s_mask = row_ok[:, None] & r_ok[None, :]
                ns = n_lo + offs_n
                y_first_mask = row_ok[:, None] & (ns < n_hi)[None, :]
                if Y_READY:
                    y_next = tl.load(y_rows + ns[None, :], mask=y_first_mask, other=0.0)
                if PRELOAD:
                    bt = load_b(b_slot, ns, offs_r, ns < n_hi, rank, max_rank, B_VEC)
                if WAIT_PRIOR:
                    tl.extra.cuda.gdc_wait()
                if not Y_READY:
                    y_next = tl.load(y_rows + ns[None, :], mask=y_first_mask, other=0.0)
                st = sum_partials(s_base, part_stride, offs_r, s_mask, split, MAX_SPLIT, True)
                if not IEEE:
                    st = st.to(b_ptr.dtype.element_ty)
                for n0 in range(n_lo, n_hi, BLOCK_N):
                    ns = n0 + offs_n
                    n_ok = ns < n_hi
                    y_mask = row_ok[:, None] & n_ok[None, :]
                    yt = y_next
                    if not PRELOAD:
                        bt = load_b(b_slot, ns, offs_r, n_ok, rank, max_rank, B_VEC)
                    ns_next = ns + BLOCK_N
                    next_ok = ns_next < n_hi
                    y_next = tl.load(
                        y_rows + ns_next[None, :], mask=row_ok[:, None] & next_ok[None, :], other=0.0
                    )
                    acc = mma(st, bt, IEEE)
                    tl.store(y_rows + ns[None, :], (yt.to(tl.float32) + acc).to(yt.dtype), mask=y_mask)
                    if PRELOAD:
                        bt = load_b(b_slot, ns_next, offs_r, next_ok, rank, max_rank, B_VEC)
            else:
                if WAIT_PRIOR:
                    tl.extra.cuda.gdc_wait()
                for n0 in range(n_lo, n_hi, BLOCK_N):
                    ns = n0 + offs_n
                    n_ok = ns < n_hi
                    y_mask = row_ok[:, None] & n_ok[None, :]
                    yt = tl.load(y_rows + ns[None, :], mask=y_mask, other=0.0)
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    for r0 in range(0, rank, BLOCK_R):
                        rs = r0 + offs_r
                        r_ok = rs < rank
                        s_mask = row_ok[:, None] & r_ok[None, :]
                        st = sum_partials(s_base, part_stride, rs, s_mask, split, MAX_SPLIT, False)
                        bt = load_b(b_slot, ns, rs, n_ok, rank, max_rank, B_VEC)
                        acc += mma(st.to(bt.dtype), bt, IEEE)
                    tl.store(y_rows + ns[None, :], (yt.to(tl.float32) + acc).to(yt.dtype), mask=y_mask)
    if WAIT_PRIOR:
        # Every program, also one with no item: the grid completes only after the shrink (and,
        # through its own waits, the kernel before it), whatever follows relies on that order.
        tl.extra.cuda.gdc_wait()
