"""One-program Triton kernel that builds LoRABatch metadata on the device in a single launch.

A stable counting sort of the rows by slot (base rows, slot -1, go to bin L, after every slot),
then each work list: item w belongs to the slot whose running tile count first exceeds w.
Gathers by a data-dependent index are done with one-hot sums over the NUM_BINS slot bins.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Kernel parameters stay unannotated (type: ignore[no-untyped-def]): Triton reads a parameter's
# annotation as a specialization hint, so a type there would change the compiled kernel.


@triton.jit
def _build_work(  # type: ignore[no-untyped-def]
    counts,
    starts,
    bins,
    max_loras,
    bound,
    slot_ptr,
    start_ptr,
    end_ptr,
    count_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    tiles = tl.where(bins < max_loras, (counts + BLOCK_M - 1) // BLOCK_M, 0)  # [NB]
    tiles_end = tl.cumsum(tiles, 0)  # [NB] inclusive
    first = tiles_end - tiles
    total = tl.sum(tiles, 0)
    tl.store(count_ptr, total)
    for w0 in range(0, bound, BLOCK_W):
        ws = w0 + tl.arange(0, BLOCK_W)
        slot = tl.sum((tiles_end[None, :] <= ws[:, None]).to(tl.int32), 1)  # [BW]
        onehot = (slot[:, None] == bins[None, :]).to(tl.int32)  # [BW, NB]
        seg = tl.sum(onehot * starts[None, :], 1)
        start = seg + (ws - tl.sum(onehot * first[None, :], 1)) * BLOCK_M
        end = seg + tl.sum(onehot * counts[None, :], 1)
        valid = ws < total
        in_bound = ws < bound
        tl.store(slot_ptr + ws, tl.where(valid, slot, -1), mask=in_bound)
        tl.store(start_ptr + ws, tl.where(valid, start, 0), mask=in_bound)
        tl.store(end_ptr + ws, tl.where(valid, end, 0), mask=in_bound)


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
    NUM_BINS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_M1: tl.constexpr,
    BLOCK_M2: tl.constexpr,
):
    bins = tl.arange(0, NUM_BINS)
    offs_t = tl.arange(0, BLOCK_T)
    counts = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for t0 in range(0, num_tokens, BLOCK_T):
        ts = t0 + offs_t
        ok = ts < num_tokens
        s = tl.load(slots_ptr + ts, mask=ok, other=-1)
        key = tl.where(ok, tl.where(s < 0, max_loras, s), NUM_BINS)  # NUM_BINS: no bin
        counts += tl.sum((key[:, None] == bins[None, :]).to(tl.int32), 0)
    starts = tl.cumsum(counts, 0) - counts  # [NB] exclusive
    tl.store(slot_starts_ptr + bins, starts, mask=bins <= max_loras)
    tl.store(slot_counts_ptr + bins, counts, mask=bins < max_loras)
    # Stable scatter: position = start of the bin + rows of the bin in earlier blocks + earlier rows
    # of the bin in this block.
    running = starts
    earlier = offs_t[None, :] < offs_t[:, None]  # [BT, BT]
    for t0 in range(0, num_tokens, BLOCK_T):
        ts = t0 + offs_t
        ok = ts < num_tokens
        s = tl.load(slots_ptr + ts, mask=ok, other=-1)
        key = tl.where(ok, tl.where(s < 0, max_loras, s), NUM_BINS)
        onehot = (key[:, None] == bins[None, :]).to(tl.int32)  # [BT, NB]
        within = tl.sum(((key[:, None] == key[None, :]) & earlier).to(tl.int32), 1)
        pos = tl.sum(onehot * running[None, :], 1) + within
        tl.store(sorted_rows_ptr + pos, ts, mask=ok)
        running += tl.sum(onehot, 0)
    _build_work(
        counts, starts, bins, max_loras, w1_bound, w1_slot, w1_start, w1_end, w1_count, BLOCK_M1, BLOCK_W
    )
    _build_work(
        counts, starts, bins, max_loras, w2_bound, w2_slot, w2_start, w2_end, w2_count, BLOCK_M2, BLOCK_W
    )
