"""One-program Triton kernel that builds LoRABatch metadata on the device in a single launch.

A stable counting sort of the rows by slot (base rows, slot -1, go to bin L, after every slot),
then each work list: item w belongs to the first slot whose running tile count exceeds w.

Its cost follows the rows and the slots separately, never their product, so a worker with a
thousand slots prepares a step about as fast as one with sixty-four:
  1. count: blocks of rows in order; a row's rank among the earlier rows of its block with its
     slot comes from a [BLOCK_T, BLOCK_T] comparison, and the last row of each slot in the block
     advances that slot's cursor in global scratch (one writer per slot, so no atomics);
  2. scan: one pass over the L + 1 bins in blocks, writing slot_starts, slot_counts, a second
     cursor set to the starts, and each work list's inclusive tile prefix per slot;
  3. place: the rows again, each written at its slot's cursor plus its rank (stable);
  4. work lists: each item finds its slot by a binary search of the tile prefix.
Steps read what earlier ones wrote through global memory, so a barrier of the whole program
separates them (and the load from the store of a cursor within a block).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Kernel parameters stay unannotated (type: ignore[no-untyped-def]): Triton reads a parameter's
# annotation as a specialization hint, so a type there would change the compiled kernel.


@triton.jit
def _rows_pass(  # type: ignore[no-untyped-def]
    slots_ptr,
    num_tokens,
    max_loras,
    cursor_ptr,
    sorted_rows_ptr,
    PLACE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_T)
    earlier = offs[None, :] < offs[:, None]  # [i, j]: row j comes before row i
    later = offs[None, :] > offs[:, None]
    for t0 in range(0, num_tokens, BLOCK_T):
        ts = t0 + offs
        ok = ts < num_tokens
        s = tl.load(slots_ptr + ts, mask=ok, other=-1)
        key = tl.where((s < 0) | (s >= max_loras), max_loras, s)  # out of range: never past the scratch
        same = (key[:, None] == key[None, :]) & ok[None, :]
        rank = tl.sum((same & earlier).to(tl.int32), 1)
        last = ok & (tl.sum((same & later).to(tl.int32), 1) == 0)
        base = tl.load(cursor_ptr + key, mask=ok, other=0, volatile=True)
        if PLACE:
            tl.store(sorted_rows_ptr + base + rank, ts, mask=ok)
        tl.debug_barrier()  # every row of the block has read its cursor before any moves
        tl.store(cursor_ptr + key, base + rank + 1, mask=last)
        tl.debug_barrier()


@triton.jit
def _fill_work(  # type: ignore[no-untyped-def]
    ends_ptr,
    slot_starts_ptr,
    slot_counts_ptr,
    max_loras,
    total,
    bound,
    slot_ptr,
    start_ptr,
    end_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    for w0 in range(0, bound, BLOCK_W):
        ws = w0 + tl.arange(0, BLOCK_W)
        # slot = how many slots' inclusive tile prefix is <= w (a search over [0, max_loras])
        lo = tl.zeros((BLOCK_W,), dtype=tl.int32)
        hi = lo + max_loras
        for _ in tl.static_range(SEARCH_STEPS):
            go = lo < hi
            mid = (lo + hi) // 2
            v = tl.load(ends_ptr + mid, mask=go, other=0, volatile=True)
            right = go & (v <= ws)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(go & (v > ws), mid, hi)
        valid = ws < total
        s = tl.minimum(lo, max_loras - 1)
        end_incl = tl.load(ends_ptr + s, volatile=True)
        count = tl.load(slot_counts_ptr + s, volatile=True)
        first_row = tl.load(slot_starts_ptr + s, volatile=True)
        first_item = end_incl - (count + BLOCK_M - 1) // BLOCK_M
        in_bound = ws < bound
        tl.store(slot_ptr + ws, tl.where(valid, lo, -1), mask=in_bound)
        tl.store(start_ptr + ws, tl.where(valid, first_row + (ws - first_item) * BLOCK_M, 0), mask=in_bound)
        tl.store(end_ptr + ws, tl.where(valid, first_row + count, 0), mask=in_bound)


# token_slots is a slice of the step's packed metadata at an offset that changes from step to step:
# left unspecialized on alignment, so no step compiles a new variant of this one-program kernel
@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
def prepare_kernel(  # type: ignore[no-untyped-def]
    slots_ptr,  # [T] int32, -1 = base model
    num_tokens,
    max_loras,
    sorted_rows_ptr,  # [T] out
    slot_starts_ptr,  # [L + 1] out
    slot_counts_ptr,  # [L] out
    count_ptr,  # [L + 1] scratch: rows per bin
    cursor_ptr,  # [L + 1] scratch: next position per bin
    ends1_ptr,  # [L] scratch: inclusive tile prefix of work list 1
    ends2_ptr,  # [L] scratch: ... of work list 2
    w1_slot,
    w1_start,
    w1_end,
    w1_count,
    w1_bound,  # work list of BLOCK_M1-row items
    w2_slot,
    w2_start,
    w2_end,
    w2_count,
    w2_bound,  # work list of BLOCK_M2-row items
    BLOCK_T: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_M1: tl.constexpr,
    BLOCK_M2: tl.constexpr,
):
    offs_l = tl.arange(0, BLOCK_L)
    for b0 in range(0, max_loras + 1, BLOCK_L):
        bins = b0 + offs_l
        tl.store(count_ptr + bins, tl.zeros((BLOCK_L,), dtype=tl.int32), mask=bins <= max_loras)
    tl.debug_barrier()
    _rows_pass(slots_ptr, num_tokens, max_loras, count_ptr, sorted_rows_ptr, False, BLOCK_T)
    rows = tl.full((), 0, dtype=tl.int32)
    tiles1 = tl.full((), 0, dtype=tl.int32)
    tiles2 = tl.full((), 0, dtype=tl.int32)
    for b0 in range(0, max_loras + 1, BLOCK_L):
        bins = b0 + offs_l
        in_range = bins <= max_loras
        is_slot = bins < max_loras
        counts = tl.load(count_ptr + bins, mask=in_range, other=0, volatile=True)
        starts = rows + tl.cumsum(counts, 0) - counts
        tl.store(slot_starts_ptr + bins, starts, mask=in_range)
        tl.store(slot_counts_ptr + bins, counts, mask=is_slot)
        tl.store(cursor_ptr + bins, starts, mask=in_range)
        t1 = tl.where(is_slot, (counts + BLOCK_M1 - 1) // BLOCK_M1, 0)
        t2 = tl.where(is_slot, (counts + BLOCK_M2 - 1) // BLOCK_M2, 0)
        tl.store(ends1_ptr + bins, tiles1 + tl.cumsum(t1, 0), mask=is_slot)
        tl.store(ends2_ptr + bins, tiles2 + tl.cumsum(t2, 0), mask=is_slot)
        rows += tl.sum(counts, 0)
        tiles1 += tl.sum(t1, 0)
        tiles2 += tl.sum(t2, 0)
    tl.store(w1_count, tiles1)
    tl.store(w2_count, tiles2)
    tl.debug_barrier()
    _rows_pass(slots_ptr, num_tokens, max_loras, cursor_ptr, sorted_rows_ptr, True, BLOCK_T)
    _fill_work(
        ends1_ptr, slot_starts_ptr, slot_counts_ptr, max_loras, tiles1, w1_bound,
        w1_slot, w1_start, w1_end, BLOCK_M1, BLOCK_W, SEARCH_STEPS,
    )  # fmt: skip
    _fill_work(
        ends2_ptr, slot_starts_ptr, slot_counts_ptr, max_loras, tiles2, w2_bound,
        w2_slot, w2_start, w2_end, BLOCK_M2, BLOCK_W, SEARCH_STEPS,
    )  # fmt: skip
