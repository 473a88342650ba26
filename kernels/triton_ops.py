"""Triton versions of the LoRA ops (same signatures as kernels.reference, arguments checked by
kernels.ops): one launch per op per module group for all slices and adapters of the batch, sized
by kernels.launch_plan."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from itertools import pairwise

import torch

from loraserve.kernels.batch import LoRABatch, max_work_items
from loraserve.kernels.launch_options import LaunchOptions, multiprocessors
from loraserve.kernels.launch_plan import (
    EXPAND_TARGET_PER_SM,
    MAX_SLICES,
    PREFILL_ROWS,
    PROGRAMS_PER_SM,
    ExpandPlan,
    ShrinkPlan,
    plan_expand,
    plan_expand_pair,
    plan_shrink,
    preload_keeps_tile,
)
from loraserve.kernels.sgmv import expand_kernel, shrink_kernel
from loraserve.kernels.sgmv_pair import expand_silu_mul_kernel


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
    pdl_self: bool = False,
) -> None:
    """pdl: let a PDL expand start as this begins; pdl_self: this shrink itself launched with PDL
    (it waits for the kernel before it only before storing)."""
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
        WAIT_PRIOR=pdl_self,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        **({"launch_pdl": True} if pdl_self else {}),
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
    y_ready: bool = True,
) -> None:
    """pdl: launched right after our own shrink (never after an unknown producer of s or y);
    y_ready: y was complete when that shrink started (False: the shrink was PDL-launched after
    y's producer, so y is read after the wait, and a PDL shrink that follows may start early)."""
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
        **_expand_constexprs(shrink, plan, part, lora_b, y),
        PRELOAD=plan.preload,
        WAIT_PRIOR=pdl,
        Y_READY=y_ready,
        LAUNCH_DEPENDENTS=not y_ready,
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
    num_sms = multiprocessors(x.device)
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
    num_sms = multiprocessors(y.device)
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


def _expand_plan(y: torch.Tensor, max_rank: int, options: LaunchOptions, pdl: bool) -> ExpandPlan:
    """add_lora's expand plan; preloading (options.expand_preload None) with PDL at decode sizes
    where the whole B tile is kept."""
    num_tokens = y.shape[0]
    preload = options.expand_preload
    if preload is None:
        preload = pdl and num_tokens < PREFILL_ROWS and preload_keeps_tile(max_rank, y.element_size())
    return plan_expand(
        num_tokens, max_rank, y.element_size(), preload=preload, b_vector_loads=options.b_vector_loads
    )


def _shrink_first(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    ranks: torch.Tensor,
    batch: LoRABatch,
    buffer: torch.Tensor | None,
    options: LaunchOptions,
) -> tuple[ShrinkPlan, torch.Tensor, bool, bool, int]:
    """Launch the shrink of an add_lora-style op into its workspace; -> (its plan, the partials,
    pdl, pdl_shrink, multiprocessors) for the expand that follows."""
    num_tokens = x.shape[0]
    _, num_slices, max_rank, _ = lora_a.shape
    workspace = batch.workspace if buffer is None else buffer
    if (
        not isinstance(workspace, torch.Tensor)
        or workspace.dtype != torch.float32
        or not workspace.is_contiguous()
        or workspace.device != x.device
    ):
        raise ValueError("buffer must be a contiguous float32 tensor on the inputs' device")
    num_sms = multiprocessors(x.device)
    per_split = num_slices * num_tokens * max_rank
    max_split = workspace.numel() // per_split
    if max_split < 1:
        raise ValueError(
            f"workspace holds {workspace.numel()} floats, add_lora needs at least {per_split} "
            f"(allocate the batch with max_slices >= {num_slices}, max_rank >= {max_rank})"
        )
    shrink = plan_shrink(num_tokens, num_slices, max_rank, x.shape[1], x.element_size(), max_split, num_sms)
    part = workspace[: shrink.max_split * per_split]
    pdl = options.pdl is not False and pdl_supported(x.device)  # None: on where supported
    pdl_shrink = pdl and options.pdl_shrink
    _launch_shrink(x, lora_a, ranks, batch, part, shrink, num_sms, pdl, pdl_shrink)
    return shrink, part, pdl, pdl_shrink, num_sms


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
    max_rank = lora_a.shape[2]
    offsets = list(slice_offsets)
    if num_tokens == 0:
        return y
    options = options if options is not None else LaunchOptions()
    shrink, part, pdl, pdl_shrink, num_sms = _shrink_first(x, lora_a, ranks, batch, buffer, options)
    expand = _expand_plan(y, max_rank, options, pdl)
    _launch_expand(
        part, shrink, x.shape[1], lora_b, ranks, batch, offsets, y, expand, num_sms, pdl, not pdl_shrink
    )
    return y


def add_lora_silu_mul(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    batch: LoRABatch,
    out: torch.Tensor,
    buffer: torch.Tensor | None = None,
    options: LaunchOptions | None = None,
) -> torch.Tensor:
    num_tokens = x.shape[0]
    max_rank = lora_a.shape[2]
    if num_tokens == 0:
        return out
    options = options if options is not None else LaunchOptions()
    shrink, part, pdl, _, num_sms = _shrink_first(x, lora_a, ranks, batch, buffer, options)
    plan = plan_expand_pair(num_tokens, max_rank, y.element_size(), b_vector_loads=options.b_vector_loads)
    inter = out.shape[1]
    n_tiles = -(-inter // plan.block_n)
    items = (
        max_work_items(num_tokens, batch.max_loras, plan.block_m) + -(-num_tokens // plan.block_m)
    ) * n_tiles
    grid = (max(1, min(items, num_sms * PROGRAMS_PER_SM)),)
    expand_silu_mul_kernel[grid](
        part,
        lora_b,
        ranks,
        y,
        out,
        *_work(batch, plan.block_m),
        batch.sorted_rows,
        batch.slot_starts[batch.max_loras :],
        num_tokens,
        inter,
        max_rank,
        EXPAND_TARGET_PER_SM * num_sms,
        shrink.col_tiles,
        x.shape[1],
        shrink.target_items,
        shrink.max_split,
        **_expand_constexprs(shrink, plan, part, lora_b, y),
        WAIT_PRIOR=pdl,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out


def _expand_constexprs(
    shrink: ShrinkPlan, plan: ExpandPlan, part: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor
) -> dict[str, int | bool]:
    """The compile-time arguments every expand kernel takes: the shrink's split and the tiles."""
    return {
        "SHRINK_BLOCK_K": shrink.block_k,
        "MAX_SPLIT": shrink.max_split,
        "MAX_CHUNK_TILES": plan.max_chunk_tiles,
        "BLOCK_M": plan.block_m,
        "BLOCK_N": plan.block_n,
        "BLOCK_R": plan.block_r,
        "SINGLE_R": plan.single_r,
        "IEEE": y.dtype == torch.float32,
        "I64": _needs_i64(part, lora_b, y),
        "B_VEC": plan.b_vec,
    }


def _needs_i64(*tensors: torch.Tensor) -> bool:
    return any(t.numel() >= 2**31 - 1 for t in tensors)
