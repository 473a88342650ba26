"""The LoRA object attached to one grouped projection (model/linear.py GroupedLinear.lora).

Semantics, for every row t whose sequence's adapter sits in slot s = token_slots[t] >= 0 and each
slice i of the group (r = rank of slot s for this layer and group):

    y[t, off_i : off_i + n_i] += (x[t] @ A[s, i, :r].T) @ B[s, off_i : off_i + n_i, :r].T

Rows with slot -1 (base model) are untouched. The kernels of `kernels/` do the work: Triton on
CUDA, their plain-torch reference elsewhere.
"""

from __future__ import annotations

import itertools

import torch

from loraserve import kernels
from loraserve.inference_worker.lora.slots import LoRASlots


class LoRALayer:
    def __init__(
        self, slots: LoRASlots, layer: int, group: str, options: kernels.LaunchOptions | None = None
    ) -> None:
        self.layer, self.group = layer, group
        self.options = options if options is not None else kernels.LaunchOptions()
        self.lora_a = slots.a[layer][group]  # [L, S, R, in]
        self.lora_b = slots.b[layer][group]  # [L, N, R]
        self.ranks = slots.group_ranks(layer, group)  # [L] int32
        self.slice_offsets = list(itertools.accumulate(slots.out_sizes[group], initial=0))  # [S + 1]

    def apply(self, x: torch.Tensor, y: torch.Tensor, lora: kernels.LoRABatch) -> None:
        # x: [T, in], y: [T, N] (added to in place)
        kernels.add_lora(
            y, x, self.lora_a, self.lora_b, self.ranks, lora, self.slice_offsets, options=self.options
        )

    def __repr__(self) -> str:
        return f"LoRALayer(layer={self.layer}, group={self.group}, slots={self.lora_a.shape[0]})"
