"""Grouped-query attention over a paged KV cache.

KV cache of one layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; a
sequence's tokens live in the blocks of its block table, token p at (table[p // bs], p % bs).
Block 0 is never handed to a sequence: padded rows of a CUDA graph write there.

Prefill segments attend causally to their cached prefix plus themselves: on CPU (and as the
reference) with SDPA, one call per segment; on CUDA with the Triton paged-prefill kernel, one
launch for all segments, reading K/V from the cache. Decode rows attend to their whole context
through the block table, either with the plain-torch gather below (CPU, reference) or the Triton
paged-decode kernel (CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from loraserve.inference_worker.model.forward_batch import ForwardBatch
from loraserve.inference_worker.model.linear import GroupedLinear, NormWeights
from loraserve.inference_worker.model.rope import apply_rope

DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    # k, v: [T, nkv, d] -> cache slots slot_mapping [T]
    nkv, d = k.shape[1], k.shape[2]
    k_cache.view(-1, nkv, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, nkv, d).index_copy_(0, slot_mapping, v)


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, nh, d], block_tables: [B, max_blocks], context_lens: [B] -> out [B, nh, d].
    Semantics: out[b] = softmax(q[b] @ K[b, :len_b].T * scale) @ V[b, :len_b], K/V through the table."""
    b, nh, d = q.shape
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    max_len = block_tables.shape[1] * bs
    k = k_cache[block_tables].view(b, max_len, nkv, d).transpose(1, 2)  # [B, nkv, L, d]
    v = v_cache[block_tables].view(b, max_len, nkv, d).transpose(1, 2)
    mask = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=nh != nkv
    )
    return out.squeeze(2)  # [B, nh, d]


def _prefix_mask(batch: ForwardBatch, i: int, q_len: int, total: int, device: torch.device) -> torch.Tensor:
    """Causal mask [q_len, total] of prefill segment i over its cached prefix and itself; built once
    per batch (every layer sees the same segments)."""
    mask = batch.prefill_masks.get(i)
    if mask is None:
        # query row r sits at position total - q_len + r and sees keys 0..that position
        rows = torch.arange(q_len, device=device)[:, None] + (total - q_len)
        mask = batch.prefill_masks[i] = torch.arange(total, device=device)[None, :] <= rows
    return mask


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """q: [P, nh, d] (prefill tokens), k, v: [P, nkv, d] -> out [P, nh, d]."""
    nh, nkv, d = q.shape[1], k.shape[1], q.shape[2]
    bs = k_cache.shape[1]
    out = torch.empty_like(q)
    for i in range(batch.num_prefills):
        s, e = batch.query_start[i], batch.query_start[i + 1]
        total, q_len = batch.context_lens_cpu[i], e - s
        if q_len == 0:  # a padding segment (graphs of steps with prefill chunks)
            continue
        if total == q_len:  # no cached prefix: attend to this chunk only
            ki, vi, mask, causal = k[s:e], v[s:e], None, True
        else:
            blocks = batch.block_tables[i, : (total + bs - 1) // bs]
            ki = k_cache[blocks].view(-1, nkv, d)[:total]
            vi = v_cache[blocks].view(-1, nkv, d)[:total]
            mask, causal = _prefix_mask(batch, i, q_len, total, q.device), False
        gqa = nh != nkv
        if gqa and q.is_cuda:  # expanded heads keep SDPA on its fused kernels (no math fallback)
            ki, vi, gqa = (
                ki.repeat_interleave(nh // nkv, dim=1),
                vi.repeat_interleave(nh // nkv, dim=1),
                False,
            )
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1).unsqueeze(0),
            ki.transpose(0, 1).unsqueeze(0),
            vi.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=gqa,
        )
        out[s:e] = o.squeeze(0).transpose(0, 1)
    return out


class Attention(nn.Module):
    def __init__(
        self,
        layer: int,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        row_linear: Callable[..., GroupedLinear] = GroupedLinear,
    ) -> None:
        """num_heads, num_kv_heads: the heads this process holds (a shard under tensor parallelism);
        `row_linear` builds the output projection (row-parallel there)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = 1.0 / math.sqrt(head_dim)
        self.qkv = GroupedLinear(
            layer, "qkv", hidden, [self.q_size, self.kv_size, self.kv_size], qkv_bias, dtype, device
        )
        self.o = row_linear(layer, "o", self.q_size, [hidden], False, dtype, device)
        # set by the model runner once the cache is allocated
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.decode_attention: DecodeAttention = decode_attention_reference
        self.fused = torch.device(device).type == "cuda"

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, hidden], cos_sin: [T, d] (cos | sin halves) -> [T, hidden]
        return self.attend(self.qkv(x, batch), cos_sin, batch)

    def attend(self, qkv: torch.Tensor, cos_sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # qkv: [T, q_size + 2 kv_size], the q|k|v projection -> [T, hidden]
        t = qkv.shape[0]
        assert self.k_cache is not None and self.v_cache is not None, "KV cache not allocated"
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.fused:  # one kernel: rotate q, k and write k, v to the cache
            from loraserve.inference_worker.model.fused_ops import rope_and_cache

            q, k = rope_and_cache(
                qkv,
                cos_sin,
                batch.slot_mapping,
                self.k_cache,
                self.v_cache,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
            )
        else:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rope(q.reshape(t, self.num_heads, self.head_dim), cos_sin)
            k = apply_rope(k.reshape(t, self.num_kv_heads, self.head_dim), cos_sin)
            write_kv(self.k_cache, self.v_cache, k, v, batch.slot_mapping)
        return self.attend_rotated(q, k, v, batch)

    def norm_attend(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm: NormWeights,
        cos_sin: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-row step where `qkv.fuses_norm`: norm(x + residual), q|k|v, RoPE and the cache write
        in one kernel (model/skinny_norm_rope.py), then the attention -> (out [1, hidden], x + residual)."""
        from loraserve.inference_worker.model.skinny_norm_rope import norm_qkv_rope

        assert self.k_cache is not None and self.v_cache is not None, "KV cache not allocated"
        q, k, v, residual = norm_qkv_rope(
            x,
            residual,
            norm.weight,
            norm.eps,
            self.qkv.weight,
            self.qkv.bias,
            cos_sin,
            batch.slot_mapping,
            self.k_cache,
            self.v_cache,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        return self.attend_rotated(q, k, v, batch), residual

    def attend_rotated(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        # q: [T, nh, d], k, v: [T, nkv, d], rotated and in the cache -> [T, hidden]
        assert self.k_cache is not None and self.v_cache is not None, "KV cache not allocated"
        t = q.shape[0]
        p = batch.num_prefill_tokens
        if batch.num_decodes == 0:
            out = self._prefill(q, k, v, batch)
        elif batch.num_prefills == 0:
            out = self.decode_attention(
                q, self.k_cache, self.v_cache, batch.block_tables, batch.context_lens, self.scale
            )
        else:
            out = torch.empty_like(q)
            self._prefill(q[:p], k[:p], v[:p], batch, out[:p])
            np_ = batch.num_prefills
            out[p:] = self.decode_attention(
                q[p:],
                self.k_cache,
                self.v_cache,
                batch.block_tables[np_:],
                batch.context_lens[np_:],
                self.scale,
            )
        return self.o(out.reshape(t, self.q_size), batch)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # q, out: [P, nh, d], k, v: [P, nkv, d] (the prefill tokens, already in the cache) -> out
        assert self.k_cache is not None and self.v_cache is not None
        if not self.fused:
            o = prefill_attention(q, k, v, self.k_cache, self.v_cache, batch, self.scale)
            return o if out is None else out.copy_(o)
        from loraserve.inference_worker.model.prefill_attention import paged_prefill_attention

        assert batch.prefill_query_start is not None, "prefill step without device query starts"
        n = batch.num_prefills
        return paged_prefill_attention(
            q,
            self.k_cache,
            self.v_cache,
            batch.block_tables[:n],
            batch.context_lens[:n],
            batch.prefill_query_start,
            self.scale,
            out=out,
        )
