"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2 shapes) over a flat token batch.

Projections are the adapter-layout groups: self_attn.qkv, self_attn.o, mlp.gate_up, mlp.down
(`grouped_linears()` lists them by (layer, group) for the LoRA code to attach to).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from loraserve.inference_worker.model.attention import Attention
from loraserve.inference_worker.model.config import ModelConfig, rope_inv_freq
from loraserve.inference_worker.model.forward_batch import ForwardBatch
from loraserve.inference_worker.model.linear import GroupedLinear
from loraserve.inference_worker.model.rope import rope_cache

# builds a row-parallel projection: (layer, group, in_features, out_sizes, bias, dtype, device)
LinearFactory = Callable[[int, str, int, list[int], bool, torch.dtype, torch.device | str], GroupedLinear]


@dataclass(frozen=True)
class LocalDims:
    """The sizes of the part of the model one process holds: all of it without tensor
    parallelism, one rank's shard with it (parallel/shard.py)."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_rows: int  # rows of embed_tokens and lm_head

    @classmethod
    def whole(cls, cfg: ModelConfig) -> LocalDims:
        return cls(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size)


def use_fused_kernels(device: torch.device | str) -> bool:
    """The Triton fused kernels serve CUDA devices; CPU runs the plain-torch twins."""
    return torch.device(device).type == "cuda"


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device), requires_grad=False)
        self.fused = use_fused_kernels(device)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, hidden] -> (norm(x + residual), x + residual); normalised in float32."""
        if self.fused:
            from loraserve.inference_worker.model.fused_ops import rms_norm

            y, r = rms_norm(x, self.weight, self.eps, residual)
            return y, (r if r is not None else x)
        if residual is not None:
            x = x + residual
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype), x


class MLP(nn.Module):
    def __init__(
        self,
        layer: int,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype,
        device: torch.device | str,
        row_linear: LinearFactory = GroupedLinear,
    ) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up = GroupedLinear(
            layer, "gate_up", hidden, [intermediate, intermediate], False, dtype, device
        )
        self.down = row_linear(layer, "down", intermediate, [hidden], False, dtype, device)
        self.fused = use_fused_kernels(device)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.fused:  # [T, 2I] -> [T, I] in one kernel, with the LoRA delta where it fuses
            from loraserve.inference_worker.model.fused_ops import silu_mul

            return self.down(self.gate_up.silu_mul(x, batch, silu_mul), batch)
        gate_up = self.gate_up(x, batch)  # [T, 2I]
        gate, up = gate_up.split(self.intermediate, dim=-1)  # [T, I] each
        return self.down(F.silu(gate) * up, batch)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        layer: int,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        dims: LocalDims,
        row_linear: LinearFactory = GroupedLinear,
    ) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(
            layer,
            h,
            dims.num_heads,
            dims.num_kv_heads,
            cfg.head_dim,
            cfg.qkv_bias,
            dtype,
            device,
            row_linear,
        )
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(layer, h, dims.intermediate_size, dtype, device, row_linear)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this layer's input delta, residual: the stream so far (None at layer 0) -> (delta, stream)."""
        attn, mlp = self.self_attn, self.mlp
        if attn.qkv.fuses_norm(x, batch):  # one row: norm, q|k|v, RoPE in one kernel
            x, residual = attn.norm_attend(x, residual, self.input_layernorm, cos_sin, batch)
        else:
            h, residual = self.input_layernorm(x, residual)
            x = attn(h, cos_sin, batch)
        assert residual is not None
        if mlp.gate_up.fuses_norm(x, batch):  # norm, gate | up, silu(gate) * up in one kernel
            act, residual = mlp.gate_up.norm_silu_mul(x, residual, self.post_attention_layernorm)
            return mlp.down(act, batch), residual
        h, residual = self.post_attention_layernorm(x, residual)
        return mlp(h, batch), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        dims: LocalDims | None = None,
        row_linear: LinearFactory = GroupedLinear,
    ) -> None:
        """`dims` and `row_linear` (the o and down projections) shape one tensor-parallel rank's
        shard (model/sharded_llama.py); by default the whole model."""
        super().__init__()
        self.config, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.dims = dims = dims if dims is not None else LocalDims.whole(cfg)
        self.num_kv_heads = dims.num_kv_heads  # KV heads in this process's cache
        self.vocab_start = 0  # first vocabulary row of embed_tokens / lm_head
        h, v = cfg.hidden_size, dims.vocab_rows
        self.embed_tokens = nn.Parameter(torch.empty(v, h, dtype=dtype, device=device), requires_grad=False)
        # a ModuleList, typed as what it holds
        self.layers: list[DecoderLayer] = nn.ModuleList(  # type: ignore[assignment]
            DecoderLayer(i, cfg, dtype, device, dims, row_linear) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.lm_head = (
            self.embed_tokens
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(v, h, dtype=dtype, device=device), requires_grad=False)
        )
        self.cos_sin: torch.Tensor  # [max_positions, head_dim] cos | sin
        self.register_buffer(
            "cos_sin", rope_cache(rope_inv_freq(cfg), cfg.max_position_embeddings, device), persistent=False
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> hidden states [T, hidden] after the final norm."""
        x = self.embed(batch.input_ids)
        cos_sin = self.cos_sin[batch.positions]  # [T, d]
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos_sin, batch)
        return self.norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        return F.embedding(input_ids, self.embed_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> logits [N, vocab] float32
        return F.linear(hidden, self.lm_head).float()

    def grouped_linears(self) -> dict[tuple[int, str], GroupedLinear]:
        out: dict[tuple[int, str], GroupedLinear] = {}
        for i, layer in enumerate(self.layers):
            for mod in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up, layer.mlp.down):
                out[(i, mod.group)] = mod
        return out

    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights in place on the model's device (benchmarks: no checkpoint needed)."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=g)
