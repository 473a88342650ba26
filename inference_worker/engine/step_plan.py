"""One step's batch as planned on the host, before it is copied to the device.

The model runner builds it from the scheduler's batch and runs it; a tensor-parallel worker's
rank 0 also sends it to the other ranks (parallel/step_channel.py), which run the same plan.

    h64  int64 [ids | positions | slot_mapping | logits_indices]   (num_tokens x 3 + num_logits)
    h32  int32 [context_lens | token_slots | prefill query starts | block_tables]
         (num_seqs + num_tokens + num_prefills + 1 + num_seqs x width)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from loraserve.kernels import LoRABatch


class LoRABatchSource(Protocol):
    """What the runner asks of the adapters: the step's LoRA batch metadata (EngineAdapters has it)."""

    def lora_batch(self, token_slots: torch.Tensor) -> LoRABatch: ...


@dataclass
class StepPlan:
    h64: torch.Tensor
    h32: torch.Tensor
    num_tokens: int  # rows of the batch, padding included
    num_seqs: int  # sequences, padding rows included
    num_logits: int
    width: int  # columns of block_tables
    num_prefills: int
    num_prefill_tokens: int
    bucket: int  # the decode graph's batch size (0: eager)
    num_sampled: int  # logits rows the engine samples from
    query_start: list[int]  # [S + 1] host ints, real sequences only
    context_lens_cpu: list[int]  # [S]
    seq_slots: list[int]  # [S] LoRA slot per sequence (-1 base)
    # decode inputs still on the device when the step was planned (asynchronous scheduling): an
    # eager step's [2, G] int64 `gather` (rows of input_ids, rows of the previous step's sampled
    # tokens); a graph step's [num_tokens] int64 `source` (None: eager), per row the row of the
    # previous step's sampled tokens it takes as input or -1 (its own id), which the graph applies
    pending: bool = False
    gather: torch.Tensor | None = None
    source: torch.Tensor | None = None
    mixed: int = 0  # the token count of the graph of steps with prefill chunks (0: none)

    @staticmethod
    def h64_numel(num_tokens: int, num_logits: int) -> int:
        """Elements of h64 for these sizes (its layout above)."""
        return 3 * num_tokens + num_logits

    @staticmethod
    def h32_numel(num_tokens: int, num_seqs: int, num_prefills: int, width: int) -> int:
        """Elements of h32 for these sizes (its layout above)."""
        return num_seqs + num_tokens + num_prefills + 1 + num_seqs * width
