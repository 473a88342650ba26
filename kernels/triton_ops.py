"""Triton versions of the LoRA ops (same signatures as kernels.reference, arguments checked by
kernels.ops): the launch plan, and one launch per op per module group for all slices and adapters
of the batch.

Launch plans depend only on host-known sizes (rows T, slots L, dims, dtype, workspace size), never
on the slot assignment, so a captured graph replays correctly for any assignment. Decode-sized
batches (T < PREFILL_ROWS) use 16-row tiles, per-slice rank tiles (skipped past a slot's rank)
and a split-K shrink for parallelism; prefill-sized ones use 64-row tiles and one column tile over
all slices so x is read once.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from loraserve.kernels.batch import MAX_SPLIT_K, LoRABatch, max_work_items
from loraserve.kernels.launch_options import LaunchOptions
from loraserve.kernels.sgmv import expand_kernel, shrink_kernel

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


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another: keep grids tiny
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: a CUDA device of compute capability 9.0+ and a Triton with
    grid dependency control (never under the interpreter)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra import cuda as tl_cuda

    return (
        torch.cuda.get_device_capability(device)[0] >= 9
        and hasattr(tl_cuda, "gdc_wait")
        and "launch_pdl" in CUDAOptions.__dataclass_fields__
    )


def preload_keeps_tile(max_rank: int, elem_size: int) -> bool:
    """Whether the preloading decode expand keeps its whole B tile (DECODE_BLOCK_N x the rank
    tile) under PRELOAD_TILE_ELEMS; where it does not, the tile halves and the step got slower."""
    block_r = max(16, _pow2(max_rank))
    return block_r * (DECODE_BLOCK_N * 2 // elem_size) <= PRELOAD_TILE_ELEMS


def block_m_for(num_tokens: int) -> int:
    return 16 if num_tokens < PREFILL_ROWS else 64


def plan_shrink(
    num_tokens: int,
    num_slices: int,
    max_rank: int,
    in_features: int,
    elem_size: int,
    max_split: int,
    num_sms: int,
) -> ShrinkPlan:
    # the token count matters only through the row tile, and max_split only up to its cap: the
    # cache below then holds a few plans per module shape, whatever the step's size
    max_split = min(max_split, SHRINK_MAX_SPLIT, MAX_SPLIT_K)
    return _shrink_plan(
        block_m_for(num_tokens), num_slices, max_rank, in_features, elem_size, max_split, num_sms
    )


# Plans are pure functions of a few ints: cached, since every layer of every step asks for one.
@functools.cache
def _shrink_plan(
    block_m: int,
    num_slices: int,
    max_rank: int,
    in_features: int,
    elem_size: int,
    max_split: int,
    num_sms: int,
) -> ShrinkPlan:
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
    max_split = max(1, min(max_split, k_blocks))  # capped by plan_shrink
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


def plan_expand(
    num_tokens: int, max_rank: int, elem_size: int, *, preload: bool = False, b_vector_loads: bool = True
) -> ExpandPlan:
    # the token count matters only through the row tile (the cache below: a few plans per shape)
    return _expand_plan(block_m_for(num_tokens), max_rank, elem_size, preload, b_vector_loads)


@functools.cache
def _expand_plan(
    block_m: int, max_rank: int, elem_size: int, preload: bool, b_vector_loads: bool
) -> ExpandPlan:
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


def _work(batch: LoRABatch, block_m: int) -> tuple[torch.Tensor, ...]:
    work = batch.work[block_m]
    return work.slot, work.start, work.end, work.count


def _launch_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    ranks: torch.Tensor,
    batch: LoRABatch,
    part: torch.Tensor,
    plan: ShrinkPlan,
    num_sms: int,
    pdl: bool = False,
) -> None:
    num_tokens, in_features = x.shape
    _, num_slices, max_rank, _ = lora_a.shape
    work_items = max_work_items(num_tokens, batch.max_loras, plan.block_m) * plan.col_tiles
    items = max(work_items, plan.target_items) if plan.max_split > 1 else work_items
    grid = (max(1, min(items, num_sms * PROGRAMS_PER_SM)),)
    shrink_kernel[grid](
        x,
        lora_a,
        ranks,
        part,
        *_work(batch, plan.block_m),
        batch.sorted_rows,
        num_tokens,
        in_features,
        max_rank,
        num_slices,
        plan.col_tiles,
        plan.col_tiles_per_slice,
        plan.target_items,
        plan.max_split,
        BLOCK_M=plan.block_m,
        BLOCK_C=plan.block_c,
        BLOCK_K=plan.block_k,
        SLICE_ALIGNED=plan.slice_aligned,
        IEEE=x.dtype == torch.float32,
        I64=_needs_i64(x, lora_a, part),
        LAUNCH_DEPENDENTS=pdl,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )


def _launch_expand(
    part: torch.Tensor,
    shrink: ShrinkPlan,
    in_features: int,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    batch: LoRABatch,
    offsets: list[int],
    y: torch.Tensor,
    plan: ExpandPlan,
    num_sms: int,
    pdl: bool = False,
) -> None:
    """pdl: launched right after our own shrink (never after an unknown producer of s or y)."""
    num_slices = len(offsets) - 1
    num_tokens, out_features = y.shape
    max_rank = lora_b.shape[2]
    tiles = [-(-(hi - lo) // plan.block_n) for lo, hi in pairwise(offsets)]
    n_tiles = sum(tiles)
    pad = MAX_SLICES - num_slices
    o = (offsets[1:-1] + [out_features] * pad)[:3]
    items = max_work_items(num_tokens, batch.max_loras, plan.block_m) * n_tiles
    grid = (max(1, min(items, num_sms * PROGRAMS_PER_SM)),)
    expand_kernel[grid](
        part,
        lora_b,
        ranks,
        y,
        *_work(batch, plan.block_m),
        batch.sorted_rows,
        num_tokens,
        out_features,
        max_rank,
        num_slices,
        *o,
        *(tiles + [0] * pad),
        EXPAND_TARGET_PER_SM * num_sms,
        shrink.col_tiles,
        in_features,
        shrink.target_items,
        shrink.max_split,
        SHRINK_BLOCK_K=shrink.block_k,
        MAX_SPLIT=shrink.max_split,
        MAX_CHUNK_TILES=plan.max_chunk_tiles,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_R=plan.block_r,
        SINGLE_R=plan.single_r,
        IEEE=y.dtype == torch.float32,
        I64=_needs_i64(part, lora_b, y),
        B_VEC=plan.b_vec,
        PRELOAD=plan.preload,
        WAIT_PRIOR=pdl,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, batch: LoRABatch, out: torch.Tensor
) -> torch.Tensor:
    num_tokens = x.shape[0]
    _, num_slices, max_rank, _ = lora_a.shape
    if num_tokens == 0:
        return out
    num_sms = _num_sms(x.device)
    plan = plan_shrink(num_tokens, num_slices, max_rank, x.shape[1], x.element_size(), 1, num_sms)
    _launch_shrink(x, lora_a, ranks, batch, out, plan, num_sms)
    return out


def lora_expand(
    s: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    batch: LoRABatch,
    slice_offsets: Sequence[int],
    y: torch.Tensor,
) -> torch.Tensor:
    offsets = list(slice_offsets)
    if batch.num_tokens == 0:
        return y
    num_sms = _num_sms(y.device)
    # A one-chunk plan: the expand reads exactly one partial, s itself.
    shrink = ShrinkPlan(
        block_m=16,
        block_c=16,
        block_k=16,
        slice_aligned=True,
        col_tiles=1,
        col_tiles_per_slice=1,
        target_items=1,
        max_split=1,
        num_warps=4,
        num_stages=1,
    )
    plan = plan_expand(batch.num_tokens, s.shape[2], y.element_size())
    _launch_expand(s, shrink, 1, lora_b, ranks, batch, offsets, y, plan, num_sms)
    return y


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    batch: LoRABatch,
    slice_offsets: Sequence[int],
    buffer: torch.Tensor | None = None,
    options: LaunchOptions | None = None,
) -> torch.Tensor:
    num_tokens = x.shape[0]
    _, num_slices, max_rank, _ = lora_a.shape
    offsets = list(slice_offsets)
    if num_tokens == 0:
        return y
    workspace = batch.workspace if buffer is None else buffer
    if (
        not isinstance(workspace, torch.Tensor)
        or workspace.dtype != torch.float32
        or not workspace.is_contiguous()
        or workspace.device != x.device
    ):
        raise ValueError("buffer must be a contiguous float32 tensor on the inputs' device")
    num_sms = _num_sms(x.device)
    per_split = num_slices * num_tokens * max_rank
    max_split = workspace.numel() // per_split
    if max_split < 1:
        raise ValueError(
            f"workspace holds {workspace.numel()} floats, add_lora needs at least {per_split} "
            f"(allocate the batch with max_slices >= {num_slices}, max_rank >= {max_rank})"
        )
    shrink = plan_shrink(num_tokens, num_slices, max_rank, x.shape[1], x.element_size(), max_split, num_sms)
    part = workspace[: shrink.max_split * per_split]
    options = options if options is not None else LaunchOptions()
    pdl = options.pdl is not False and pdl_supported(x.device)  # None: on where supported
    _launch_shrink(x, lora_a, ranks, batch, part, shrink, num_sms, pdl)
    preload = options.expand_preload
    if preload is None:
        preload = pdl and num_tokens < PREFILL_ROWS and preload_keeps_tile(max_rank, y.element_size())
    expand = plan_expand(
        num_tokens, max_rank, y.element_size(), preload=preload, b_vector_loads=options.b_vector_loads
    )
    _launch_expand(part, shrink, x.shape[1], lora_b, ranks, batch, offsets, y, expand, num_sms, pdl)
    return y


def _needs_i64(*tensors: torch.Tensor) -> bool:
    return any(t.numel() >= 2**31 - 1 for t in tensors)
