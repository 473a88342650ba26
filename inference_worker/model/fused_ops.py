"""Fused Triton kernels of the CUDA decode path, each the same function as a plain-torch twin in
the model code (RMSNorm.forward, apply_rope + write_kv, silu(gate) * up). They cut the number of
launches per layer (a decode step at small batch is bound by launch count, not bytes).

    rms_norm(x [T, H], w [H], residual [T, H] | None) -> y [T, H] (and residual' [T, H]):
        residual' = x + residual; y = w * (r / sqrt(mean(r^2) + eps)), r = residual' (or x)
    rope_and_cache(qkv [T, (nh + 2 nkv) d], cos_sin [T, d], slots [T]) -> q [T, nh, d], k [T, nkv, d]:
        q, k rotated (halves convention); rotated k and plain v written to cache slot slots[t]
    silu_mul(gate_up [T, 2 I]) -> [T, I]: silu(gate) * up
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraserve.inference_worker.model.launch import pdl_launch

# Kernel parameters stay unannotated (type: ignore[no-untyped-def]): Triton reads a parameter's
# annotation as a specialization hint, so a type there would change the compiled kernel.


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    X, R, W, Y, RO, H, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, WAIT_PRIOR: tl.constexpr = False
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    w = tl.load(W + offs, mask=m, other=0.0)  # a weight: no kernel of the step writes it
    if WAIT_PRIOR:  # launched with PDL (model/launch.py): x and the residual after the kernel before
        tl.extra.cuda.gdc_wait()
    x = tl.load(X + row * H + offs, mask=m, other=0.0)
    if HAS_RES:
        x = x + tl.load(R + row * H + offs, mask=m, other=0.0)  # in the activation dtype, as the reference
        tl.store(RO + row * H + offs, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / H
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    tl.store(Y + row * H + offs, w * y, mask=m)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    t, h = x.shape
    x = x.contiguous()
    y = torch.empty_like(x)
    ro = torch.empty_like(x) if residual is not None else None
    _rms_norm_kernel[(t,)](
        x,
        residual.contiguous() if residual is not None else x,
        weight,
        y,
        ro if ro is not None else y,
        h,
        eps,
        HAS_RES=residual is not None,
        BLOCK=triton.next_power_of_2(h),
        num_warps=8 if h >= 4096 else 4,
        **pdl_launch(x.device),
    )
    return y, ro


@triton.jit
def _rope_cache_kernel(  # type: ignore[no-untyped-def]
    QKV,
    CS,
    SLOT,
    QO,
    KO,
    KC,
    VC,
    s_qkv,
    s_cs,
    NH,
    NKV,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BH: tl.constexpr,
    WAIT_PRIOR: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    if WAIT_PRIOR:  # launched with PDL (model/launch.py)
        tl.extra.cuda.gdc_wait()
    j = tl.arange(0, HALF)
    hs = tl.arange(0, BH)
    cos = tl.load(CS + t * s_cs + j)[None, :]
    sin = tl.load(CS + t * s_cs + HALF + j)[None, :]
    slot = tl.load(SLOT + t)
    row = QKV + t * s_qkv
    # q heads
    mq = (hs < NH)[:, None]
    q1 = tl.load(row + hs[:, None] * D + j[None, :], mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(row + hs[:, None] * D + HALF + j[None, :], mask=mq, other=0.0).to(tl.float32)
    qo = QO + t * NH * D + hs[:, None] * D + j[None, :]
    tl.store(qo, (q1 * cos - q2 * sin).to(QO.dtype.element_ty), mask=mq)
    tl.store(qo + HALF, (q2 * cos + q1 * sin).to(QO.dtype.element_ty), mask=mq)
    # k heads: rotated, to the output and the cache; v heads: to the cache
    mk = (hs < NKV)[:, None]
    kb = row + NH * D
    k1 = tl.load(kb + hs[:, None] * D + j[None, :], mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(kb + hs[:, None] * D + HALF + j[None, :], mask=mk, other=0.0).to(tl.float32)
    r1 = (k1 * cos - k2 * sin).to(KO.dtype.element_ty)
    r2 = (k2 * cos + k1 * sin).to(KO.dtype.element_ty)
    ko = KO + t * NKV * D + hs[:, None] * D + j[None, :]
    tl.store(ko, r1, mask=mk)
    tl.store(ko + HALF, r2, mask=mk)
    kc = KC + slot * NKV * D + hs[:, None] * D + j[None, :]
    tl.store(kc, r1, mask=mk)
    tl.store(kc + HALF, r2, mask=mk)
    vb = row + (NH + NKV) * D
    vc = VC + slot * NKV * D + hs[:, None] * D + j[None, :]
    tl.store(vc, tl.load(vb + hs[:, None] * D + j[None, :], mask=mk, other=0.0), mask=mk)
    tl.store(vc + HALF, tl.load(vb + hs[:, None] * D + HALF + j[None, :], mask=mk, other=0.0), mask=mk)


def rope_and_cache(
    qkv: torch.Tensor,
    cos_sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    t = qkv.shape[0]
    assert (
        qkv.stride(1) == 1 and cos_sin.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    )
    q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    _rope_cache_kernel[(t,)](
        qkv,
        cos_sin,
        slot_mapping,
        q,
        k,
        k_cache,
        v_cache,
        qkv.stride(0),
        cos_sin.stride(0),
        num_heads,
        num_kv_heads,
        D=head_dim,
        HALF=head_dim // 2,
        BH=triton.next_power_of_2(max(num_heads, num_kv_heads)),
        num_warps=4,
        **pdl_launch(qkv.device),
    )
    return q, k


@triton.jit
def _silu_mul_kernel(X, Y, inter, BLOCK: tl.constexpr, WAIT_PRIOR: tl.constexpr = False):  # type: ignore[no-untyped-def]
    t = tl.program_id(0).to(tl.int64)
    if WAIT_PRIOR:  # launched with PDL (model/launch.py)
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < inter
    g = tl.load(X + t * 2 * inter + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(X + t * 2 * inter + inter + offs, mask=m, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(Y + t * inter + offs, s * u, mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    t, two_i = gate_up.shape
    inter = two_i // 2
    gate_up = gate_up.contiguous()
    y = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](
        gate_up, y, inter, BLOCK=block, num_warps=4, **pdl_launch(gate_up.device)
    )
    return y
