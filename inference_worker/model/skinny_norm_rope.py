"""A one-row decode step's input RMSNorm, q|k|v projection, RoPE and KV-cache write in one kernel
(model/skinny_norm.py's kernel with its RoPE epilogue):

    norm_qkv_rope(x [1, H], residual, norm_w, eps, weight [(nh + 2 nkv) d, H], bias | None,
                  cos_sin [1, d], slot_mapping [1], k_cache, v_cache, nh, nkv, d)
        -> q [1, nh, d], k [1, nkv, d], v [1, nkv, d], residual' [1, H]

what skinny_norm.norm_linear and then fused_ops.rope_and_cache compute, rounded where they round:
the projection to the activation dtype, the rotation in float32 (halves convention); k rotated and
v written to cache slot slot_mapping[0]. Each program takes BLOCK_N rotation pairs of one head,
rows j and j + d / 2 of its weight, so it holds both halves it rotates. One kernel fewer a layer
than the norm folded into q|k|v alone.
"""

from __future__ import annotations

import torch

from loraserve.inference_worker.model.rope import apply_rope
from loraserve.inference_worker.model.skinny_gemm import SkinnyConfig
from loraserve.inference_worker.model.skinny_norm import (
    check_args,
    default_config,
    norm_linear_reference,
    run_kernel,
)


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    cos_sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    heads: tuple[int, int, int],
) -> None:
    nh, nkv, d = heads
    if d < 2 or d % 2 or nh < 1 or nkv < 1:
        raise ValueError(f"heads must be >= 1 and head_dim even, got {nh}, {nkv}, {d}")
    if weight.shape[0] != (nh + 2 * nkv) * d:
        raise ValueError(f"weight has {weight.shape[0]} rows, q|k|v of {heads} needs {(nh + 2 * nkv) * d}")
    if cos_sin.shape != (1, d) or cos_sin.dtype != torch.float32:
        raise ValueError(f"cos_sin must be [1, {d}] float32, got {tuple(cos_sin.shape)} {cos_sin.dtype}")
    if slot_mapping.shape != (1,) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be [1] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    for cache in (k_cache, v_cache):
        if (
            cache.dim() != 4
            or cache.shape[2:] != (nkv, d)
            or cache.dtype != x.dtype
            or not cache.is_contiguous()
        ):
            raise ValueError(
                f"caches must be contiguous [blocks, block_size, {nkv}, {d}] of {x.dtype}, "
                f"got {tuple(cache.shape)} {cache.dtype}"
            )
    if any(t.device != x.device for t in (cos_sin, slot_mapping, k_cache, v_cache)):
        raise ValueError("all tensors must be on one device")


def norm_qkv_rope_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos_sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    config: SkinnyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain-torch twin (config is ignored)."""
    _check(x, weight, cos_sin, slot_mapping, k_cache, v_cache, (num_heads, num_kv_heads, head_dim))
    y, r = norm_linear_reference(x, residual, norm_weight, eps, weight, bias)
    nh, nkv, d = num_heads, num_kv_heads, head_dim
    q = apply_rope(y[:, : nh * d].view(1, nh, d), cos_sin)
    k = apply_rope(y[:, nh * d : (nh + nkv) * d].view(1, nkv, d), cos_sin)
    v = y[:, (nh + nkv) * d :].reshape(1, nkv, d)
    k_cache.view(-1, nkv, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, nkv, d).index_copy_(0, slot_mapping, v)
    return q, k, v, r


def norm_qkv_rope(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos_sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    config: SkinnyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module's docstring; config: the tiles of skinny_norm (default_config when None;
    block_n is cut to a power of two that divides head_dim / 2)."""
    heads = (num_heads, num_kv_heads, head_dim)
    check_args(x, residual, norm_weight, weight, bias, False)
    _check(x, weight, cos_sin, slot_mapping, k_cache, v_cache, heads)
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    norm_weight, weight = norm_weight.contiguous(), weight.contiguous()
    cos_sin = cos_sin.contiguous()
    nh, nkv, d = heads
    half = d // 2
    cfg = config or default_config(weight.shape[0], x.shape[1], False)
    block_n = cfg.block_n
    while half % block_n:
        block_n //= 2
    if block_n != cfg.block_n:
        cfg = SkinnyConfig(block_n, cfg.block_k, 1, cfg.num_warps, cfg.num_stages, use_dot=False)
    q = torch.empty((1, nh, d), dtype=x.dtype, device=x.device)
    k = torch.empty((1, nkv, d), dtype=x.dtype, device=x.device)
    v = torch.empty((1, nkv, d), dtype=x.dtype, device=x.device)
    ro = torch.empty_like(x) if residual is not None else x
    grid = ((nh + 2 * nkv) * half // block_n,)
    rope = (cos_sin, slot_mapping, q, k, v, k_cache, v_cache)
    run_kernel(grid, cfg, x, residual, ro, norm_weight, eps, weight, bias, q, 0, False, rope, (nh, nkv, half))
    return q, k, v, ro
