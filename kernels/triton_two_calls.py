"""add_lora in two calls on the Triton kernels (kernels.ops.add_lora_begin / add_lora_finish): the
shrink first, so it can run on another stream beside y's producer, then the expand once y exists.
Both launch add_lora's own kernels with its plans (triton_ops)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraserve.kernels.batch import LoRABatch
from loraserve.kernels.launch_options import LaunchOptions
from loraserve.kernels.launch_plan import ShrinkPlan
from loraserve.kernels.triton_ops import _expand_plan, _launch_expand, _shrink_first, pdl_supported


@dataclass(frozen=True)
class Begun:
    """What add_lora_begin launched, for add_lora_finish: the shrink's plan and partial sums."""

    shrink: ShrinkPlan
    part: torch.Tensor
    in_features: int
    num_sms: int


def add_lora_begin(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    ranks: torch.Tensor,
    batch: LoRABatch,
    buffer: torch.Tensor | None = None,
    options: LaunchOptions | None = None,
) -> Begun | None:
    """add_lora's shrink alone (split over K as add_lora splits it), launched plainly: the caller
    runs it on another stream beside y's producer."""
    if x.shape[0] == 0:
        return None
    options = options if options is not None else LaunchOptions()
    alone = dataclasses.replace(options, pdl=False, pdl_shrink=False)
    shrink, part, _, _, num_sms = _shrink_first(x, lora_a, ranks, batch, buffer, alone)
    return Begun(shrink, part, x.shape[1], num_sms)


def add_lora_finish(
    begun: Begun | None,
    y: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    batch: LoRABatch,
    slice_offsets: Sequence[int],
    options: LaunchOptions | None = None,
) -> torch.Tensor:
    """add_lora's expand of `begun`'s partial sums into y. With PDL (options.pdl, where supported)
    it is launched right after y's producer: its programs start as that kernel ends, read their
    work items and B, and read y only after waiting for it; the shrink's partial sums must be
    complete before it is launched (the caller waits for the shrink's stream)."""
    num_tokens = y.shape[0]
    if begun is None or num_tokens == 0:
        return y
    options = options if options is not None else LaunchOptions()
    pdl = options.pdl is not False and pdl_supported(y.device)
    plan = _expand_plan(y, lora_b.shape[2], options, pdl)
    _launch_expand(
        begun.part,
        begun.shrink,
        begun.in_features,
        lora_b,
        ranks,
        batch,
        list(slice_offsets),
        y,
        plan,
        begun.num_sms,
        pdl,
        y_ready=not pdl,  # launched plainly, y's producer has ended before it starts
    )
    return y
