"""Launch plans of the Triton LoRA ops: tile sizes, split-K and pipeline depth as pure functions
of host-known sizes (rows, slices, rank, features, dtype, workspace, multiprocessors), never of the
slot assignment, so a captured graph replays correctly for any assignment.

Decode-sized batches (T < PREFILL_ROWS) use 16-row tiles, per-slice rank tiles (skipped past a
slot's rank) and a split-K shrink for parallelism; prefill-sized ones use 64-row tiles and one
column tile over all slices so x is read once.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from loraserve.kernels.batch import MAX_SPLIT_K

MAX_SLICES = 4
# Launch tunables (measured on an H200, see benchmarks/results/kernels.md).
PREFILL_ROWS = 512  # from this many rows on: 64-row tiles, one column tile over all slices
PROGRAMS_PER_SM = 8  # persistent programs per multiprocessor (upper bound of the grid)
SHRINK_TARGET_PER_SM = 4  # split K until (work items x column tiles x chunks) reaches this per SM
SHRINK_MAX_SPLIT = 8  # at most this many K chunks (<= MAX_SPLIT_K)
DECODE_BLOCK_N = 256  # expand output columns per dot (16-bit types; halved for fp32 / wide ranks)
PREFILL_BLOCK_N = 128
EXPAND_TARGET_PER_SM = 4  # expand items widen up to MAX_CHUNK_TILES tiles until about this many per SM
DECODE_MAX_CHUNK_TILES = 16
PREFILL_MAX_CHUNK_TILES = 4
EXPAND_TILE_ELEMS = 16384  # B elements per expand tile (BLOCK_R x BLOCK_N)
# Smaller B tiles where 16K-element ones spill registers (ptxas for sm_90; tests/kernels/
# test_sgmv_compile.py checks every planned variant): ranks past SINGLE_RANK_TILE, whose s is
# summed tile by tile, and the preloading expand, whose first B tile stays live across the s load.
LOOPED_RANK_TILE_ELEMS = 4096
PRELOAD_TILE_ELEMS = 8192
# add_lora_silu_mul's expand: output columns per tile (16-bit types; halved for fp32), and the
# step size from which the model uses it (measured, benchmarks/results/overhead.md, 2026-11-28)
PAIR_DECODE_BLOCK_N = 64
PAIR_PREFILL_BLOCK_N = 32
FUSED_SILU_MUL_MIN_ROWS = 1024
SHRINK_SMEM_BYTES = 110 * 1024  # decode shrink pipeline stages fit in this: two programs per SM
PREFILL_SHRINK_SMEM_BYTES = 160 * 1024
SINGLE_RANK_TILE = 128  # buffers up to this rank keep the whole s row tile in registers
# 16-byte B vectors (LaunchOptions.b_vector_loads) up to this buffer rank.
B_VECTOR_MAX_RANK = 64


@dataclass(frozen=True)
class ShrinkPlan:
    block_m: int
    block_c: int
    block_k: int
    slice_aligned: bool
    col_tiles: int
    col_tiles_per_slice: int
    target_items: int
    max_split: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ExpandPlan:
    block_m: int
    block_n: int
    block_r: int
    max_chunk_tiles: int
    single_r: bool
    num_warps: int
    num_stages: int
    preload: bool = False  # the item's first B and y tiles load before its s
    b_vec: int = 1  # elements per B load vector along the rank (1: exact rank masks)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def preload_keeps_tile(max_rank: int, elem_size: int) -> bool:
    """Whether the preloading decode expand keeps its whole B tile (DECODE_BLOCK_N x the rank
    tile) under PRELOAD_TILE_ELEMS; where it does not, the tile halves and the step got slower."""
    block_r = max(16, _pow2(max_rank))
    return block_r * (DECODE_BLOCK_N * 2 // elem_size) <= PRELOAD_TILE_ELEMS


def block_m_for(num_tokens: int) -> int:
    return 16 if num_tokens < PREFILL_ROWS else 64


# Plans are pure functions of a few ints, asked for by every layer of every step: cached (bounded,
# since the token count and the workspace's split cap vary with the step's size).
@functools.lru_cache(maxsize=4096)
def plan_shrink(
    num_tokens: int,
    num_slices: int,
    max_rank: int,
    in_features: int,
    elem_size: int,
    max_split: int,
    num_sms: int,
) -> ShrinkPlan:
    block_m = block_m_for(num_tokens)
    if block_m == 16:
        # Decode: one slice per column tile, so tiles past a low rank are skipped entirely.
        block_c = min(max(16, _pow2(max_rank)), 128)
        per_slice = -(-max_rank // block_c)
        col_tiles, aligned, num_warps = num_slices * per_slice, True, 4
        block_k = 256 if block_c <= 64 else 128
    else:
        # Prefill: all slices in as few column tiles as possible, so x streams once.
        block_c = min(max(16, _pow2(num_slices * max_rank)), 256)
        per_slice = 1
        col_tiles, aligned, num_warps = -(-num_slices * max_rank // block_c), False, 8
        block_k = 64
    block_k = max(16, min(block_k * 2 // elem_size, _pow2(in_features)))
    k_blocks = -(-in_features // block_k)
    max_split = max(1, min(max_split, SHRINK_MAX_SPLIT, MAX_SPLIT_K, k_blocks))
    stage_bytes = (block_m + block_c) * block_k * elem_size
    smem = SHRINK_SMEM_BYTES if block_m == 16 else PREFILL_SHRINK_SMEM_BYTES
    num_stages = max(1, min(4, smem // stage_bytes))
    return ShrinkPlan(
        block_m=block_m,
        block_c=block_c,
        block_k=block_k,
        slice_aligned=aligned,
        col_tiles=col_tiles,
        col_tiles_per_slice=per_slice,
        target_items=SHRINK_TARGET_PER_SM * num_sms,
        max_split=max_split,
        num_warps=num_warps,
        num_stages=num_stages,
    )


@functools.lru_cache(maxsize=4096)
def plan_expand(
    num_tokens: int, max_rank: int, elem_size: int, *, preload: bool = False, b_vector_loads: bool = True
) -> ExpandPlan:
    block_m = block_m_for(num_tokens)
    single_r = _pow2(max_rank) <= SINGLE_RANK_TILE
    block_r = max(16, _pow2(max_rank)) if single_r else 64
    if block_m == 16:
        block_n, tiles, num_warps = DECODE_BLOCK_N, DECODE_MAX_CHUNK_TILES, 4
    else:
        block_n, tiles, num_warps = PREFILL_BLOCK_N, PREFILL_MAX_CHUNK_TILES, 8
    block_n = block_n * 2 // elem_size
    preload = preload and single_r
    if not single_r:
        max_elems = LOOPED_RANK_TILE_ELEMS
    else:
        max_elems = PRELOAD_TILE_ELEMS if preload else EXPAND_TILE_ELEMS
    while block_n > 32 and block_n * block_r > max_elems:
        block_n //= 2
    # 16-byte B vectors where they fit the buffer rank; the wider single-rank tiles spill with them
    vec = 16 // elem_size
    b_vec = vec if b_vector_loads and max_rank % vec == 0 and max_rank <= B_VECTOR_MAX_RANK else 1
    return ExpandPlan(
        block_m=block_m,
        block_n=block_n,
        block_r=block_r,
        max_chunk_tiles=tiles,
        single_r=single_r,
        num_warps=num_warps,
        num_stages=3 if single_r else 1,
        preload=preload,
        b_vec=b_vec,
    )


def fuse_silu_mul_pays(num_tokens: int) -> bool:
    """Whether add_lora_silu_mul measured faster than add_lora and then the activation kernel for
    a step of `num_tokens` rows (LaunchOptions.fused_silu_mul=None)."""
    return num_tokens >= FUSED_SILU_MUL_MIN_ROWS


@functools.lru_cache(maxsize=4096)
def plan_expand_pair(
    num_tokens: int, max_rank: int, elem_size: int, *, b_vector_loads: bool = True
) -> ExpandPlan:
    """The expand of two slices at once (add_lora_silu_mul: gate and up): plan_expand's row tiles
    with narrow output tiles. It holds two B tiles and prefetches two y tiles; wide tiles spill or
    keep too few programs per multiprocessor, and narrow ones measured fastest (H100,
    benchmarks/bench_fused_silu.py: 64 columns at decode sizes, 32 at prefill sizes, 4 warps)."""
    plan = plan_expand(num_tokens, max_rank, elem_size, b_vector_loads=b_vector_loads)
    block_n = PAIR_DECODE_BLOCK_N if plan.block_m == 16 else PAIR_PREFILL_BLOCK_N
    # 4 warps were measured (16-bit, rank 16); other decode tiles keep ptxas (Triton 3.6) off
    # the stack with 8 (tests/kernels/test_sgmv_compile.py, under both Triton versions)
    num_warps = 8 if plan.block_m == 16 and (elem_size != 2 or plan.block_r > 16) else 4
    return dataclasses.replace(plan, block_n=block_n * 2 // elem_size, num_warps=num_warps)
