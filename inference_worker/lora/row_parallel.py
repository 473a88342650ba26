"""LoRA on a tensor-parallel rank's projections (S-LoRA's sharding, parallel/shard.py).

Column-parallel groups (qkv, gate_up) need nothing new: A is whole, so the shrink of the
replicated input is the same on every rank, and the expand writes the rank's rows of B into its
output columns. Row-parallel groups (o, down) see only the rank's input columns, so the shrink is a
partial sum: it is all-reduced — [slices, T, R], rank-sized, the only communication adapters add —
before the expand with the whole B into the already all-reduced base output:

    s = all_reduce(x_r @ A[slot, :, :r, cols_r].T)      # [1, T, r]
    y[t] += s[t] @ B[slot, :, :r].T
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loraserve import kernels
from loraserve.inference_worker.lora.layer import LoRALayer
from loraserve.inference_worker.lora.slots import LoRASlots
from loraserve.inference_worker.model.llama import LlamaModel

ROW_PARALLEL_GROUPS = ("o", "down")


class RowParallelLoRALayer(LoRALayer):
    def __init__(
        self,
        slots: LoRASlots,
        layer: int,
        group: str,
        all_reduce: Callable[[torch.Tensor], None],
        options: kernels.LaunchOptions | None = None,
    ) -> None:
        super().__init__(slots, layer, group, options)
        self.all_reduce = all_reduce

    def finish(self, x: torch.Tensor, y: torch.Tensor, lora: kernels.LoRABatch, begun: object) -> None:
        # x: [T, in / N] this rank's columns, y: [T, N_out] the reduced base output (added to)
        _, num_slices, max_rank, _ = self.lora_a.shape
        n = num_slices * x.shape[0] * max_rank
        s = lora.workspace[:n].view(num_slices, x.shape[0], max_rank)
        kernels.lora_shrink(x, self.lora_a, self.ranks, lora, s)
        self.all_reduce(s)
        kernels.lora_expand(s, self.lora_b, self.ranks, lora, self.slice_offsets, y)


def attach_sharded_lora(
    model: LlamaModel,
    slots: LoRASlots,
    all_reduce: Callable[[torch.Tensor], None],
    options: kernels.LaunchOptions,
) -> None:
    """A LoRA layer on every grouped projection of a rank's shard: row-parallel ones reduce their
    shrink (WorkerAdapters.attach_to is the single-process twin)."""
    for (layer, group), module in model.grouped_linears().items():
        module.lora = (
            RowParallelLoRALayer(slots, layer, group, all_reduce, options)
            if group in ROW_PARALLEL_GROUPS
            else LoRALayer(slots, layer, group, options)
        )
