"""The checks and strides the paged attention kernels (decode_attention.py, prefill_attention.py)
share: q [rows, nh, d], k_cache/v_cache [num_blocks, bs, nkv, d], block_tables [seqs, max_blocks]
int32, context_lens [seqs] int32."""

from __future__ import annotations

import torch


def paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, int, tuple[int, ...]]:
    """-> (q contiguous, block_tables contiguous, query heads per KV head, the strides both kernels
    take in this order: q's row and head, the cache's block, slot and head, the table's row)."""
    _, nh, d = q.shape
    nkv = k_cache.shape[2]
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
    assert d & (d - 1) == 0 and d >= 16, "head_dim must be a power of two >= 16"
    assert nh % nkv == 0, "query heads must be a multiple of KV heads"
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    strides = (
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
    )
    return q, block_tables, nh // nkv, strides
