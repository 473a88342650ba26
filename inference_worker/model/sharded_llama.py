"""One tensor-parallel rank's shard of the Llama-family decoder (Megatron-style, parallel/shard.py).

Per layer: q|k|v and gate|up are column-parallel (this rank's heads / intermediate columns, no
communication), o and down row-parallel (`RowParallelLinear`: a partial product over this rank's
input columns, all-reduced). The embedding and the LM head are vocab-parallel: each rank looks up
or scores its rows of the vocabulary; embeddings are all-reduced (a token's row lives on one rank),
logits all-gathered. Two all-reduces per layer, one per forward for the embedding, one all-gather.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.nn import functional as F

from loraserve.inference_worker.model.config import ModelConfig
from loraserve.inference_worker.model.forward_batch import ForwardBatch
from loraserve.inference_worker.model.linear import GroupedLinear
from loraserve.inference_worker.model.llama import LlamaModel, LocalDims
from loraserve.inference_worker.parallel.group import TensorParallelGroup
from loraserve.inference_worker.parallel.shard import check_tensor_parallel


class RowParallelLinear(GroupedLinear):
    """y = all_reduce(x_r @ W_r.T) with x_r, W_r this rank's input columns; then the LoRA delta,
    whose layer (lora/row_parallel.py) all-reduces only its rank-sized shrink output."""

    def __init__(
        self,
        tp: TensorParallelGroup,
        layer: int,
        group: str,
        in_features: int,
        out_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if bias:
            raise ValueError(f"row-parallel {group} takes no bias (the Llama family has none)")
        super().__init__(layer, group, in_features, out_sizes, False, dtype, device)
        self.tp = tp

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, in / N] -> y: [T, out], the same on every rank
        y = F.linear(x, self.weight)
        self.tp.all_reduce(y)
        if self.lora is not None and batch.lora is not None:
            self.lora.finish(x, y, batch.lora, None)
        return y


class ShardedLlamaModel(LlamaModel):
    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, tp: TensorParallelGroup
    ) -> None:
        check_tensor_parallel(cfg, tp.size)
        shard = tp.shard
        vocab_start, vocab_rows = shard.vocab(cfg.vocab_size)
        dims = LocalDims(
            num_heads=cfg.num_heads // shard.size,
            num_kv_heads=shard.kv_heads(cfg.num_kv_heads)[1],
            intermediate_size=cfg.intermediate_size // shard.size,
            vocab_rows=vocab_rows,
        )
        super().__init__(cfg, dtype, device, dims, partial(RowParallelLinear, tp))
        self.tp = tp
        self.vocab_start = vocab_start

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]; rows of tokens outside this rank's vocabulary are zero
        # before the all-reduce, which adds the one rank's row that holds each token
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.dims.vocab_rows)
        x = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        self.tp.all_reduce(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> logits [N, vocab] float32 (the padding rows of the last shard cut)
        local = F.linear(hidden, self.lm_head)  # [N, V_pad / size]
        return self.tp.all_gather_columns(local)[:, : self.config.vocab_size].float().contiguous()
