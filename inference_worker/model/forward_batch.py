"""The per-step forward context: what one model call computes, passed explicitly to every layer.

A step runs the scheduled sequences as one flat token batch: first the prefill chunks (one
segment of `query_lens[i]` tokens per prefilling sequence), then one token per decoding sequence.

    input_ids      [T] int64   tokens of this step
    positions      [T] int64   their positions in their sequences
    slot_mapping   [T] int64   KV-cache slot written by each token (block * block_size + offset)
    token_slots    [T] int32   LoRA slot of each token's sequence, -1 = base model
    block_tables   [S, max_blocks] int32  physical KV blocks of each sequence (0-padded)
    context_lens   [S] int32   tokens in the cache for each sequence after this step
    query_start    [S + 1]     offsets of each sequence's tokens in the flat batch (CPU list)
    prefill_query_start [num_prefills + 1] int32  the prefills' part of query_start, on the device
    logits_indices [N] int64   rows whose next-token logits are needed (last token of a segment)

`lora` is the step's `kernels.LoRABatch` (its rows grouped by slot; None: no adapter in the batch),
built from `token_slots` by the engine's adapters; the grouped projections pass it to their
`lora.apply`. Nothing here is module-global.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraserve.kernels import LoRABatch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    logits_indices: torch.Tensor
    token_slots: torch.Tensor
    num_prefills: int = 0
    num_prefill_tokens: int = 0
    num_decodes: int = 0
    query_start: list[int] = field(default_factory=list)  # [S + 1], host ints
    context_lens_cpu: list[int] = field(default_factory=list)  # [S], host ints
    seq_slots: list[int] = field(default_factory=list)  # [S] LoRA slot per sequence (-1 base)
    lora: LoRABatch | None = None
    # read by the prefill attention kernel; None when the step has no prefill
    prefill_query_start: torch.Tensor | None = None
    # causal masks of the prefill segments that attend to a cached prefix, by segment index;
    # built by the first attention layer, reused by the others
    prefill_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
