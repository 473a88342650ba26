"""The RMSNorm of a one-row decode step folded into the projection that reads it (the skinny GEMM's
one-row path, model/skinny_gemm.py), and for gate | up the SiLU x up after it:

    norm_linear(x [1, K], residual [1, K] | None, norm_w [K], eps, weight [N, K], bias [N] | None)
        -> (y [1, N], residual' [1, K]):
        residual' = x + residual (x without one); h = norm_w * (r / sqrt(mean(r^2) + eps)), r = residual'
        y = h @ weight.T (+ bias)
    pair=True (a gate | up weight [2I, K], no bias): y [1, I] = silu(g) * up, g | up = h @ weight.T

The same kernel's RoPE epilogue (ROPE; model/skinny_norm_rope.py) rotates a q|k|v projection and
writes k and v to the KV cache, so a one-row layer's input norm, q|k|v, RoPE and cache write are
one launch.

Each rounding is where the separate kernels round (fused_ops.rms_norm, then the skinny GEMM, then
fused_ops.silu_mul): x + residual and h in the activation dtype, the products summed in fp32 and
rounded once, silu(g) rounded before the product. So the step runs one kernel where it ran two or
three; at one row the norm kernel and the activation kernel are each mostly launch latency.

Every program reads the whole row (x, the residual, the norm weight: a few KB, from L1 after the
first program on a multiprocessor) twice: once for the mean square, once while it streams its
BLOCK_N weight rows (both halves' rows with `pair`). Program 0 stores residual'. Launched with PDL
(model/launch.py) like the skinny GEMM: the first weight tiles load before the wait, everything
else after it.

The model uses it where `GroupedLinear.fuses_norm` says (model/linear.py): gate | up through
`GroupedLinear.norm_silu_mul`, q|k|v through `Attention.norm_attend`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraserve.inference_worker.model.launch import pdl_launch
from loraserve.inference_worker.model.skinny_gemm import DTYPES, SkinnyConfig, _w_tile

# Kernel parameters stay unannotated (type: ignore[no-untyped-def]): Triton reads a parameter's
# annotation as a specialization hint, so a type there would change the compiled kernel.


def default_config(n: int, k: int, pair: bool) -> SkinnyConfig:
    """What measured fastest on an H200 (benchmarks/bench_skinny_norm.py, 1B and 8B shapes;
    benchmarks/results/skinny_norm_h200_2026-11-29.md): q|k|v as the skinny GEMM's one-row default
    (8 weight rows a program, 512 of K a step, 2 warps up to 8M weights, 4 above); gate | up 16 rows
    of each half a program, 256 of K a step, 4 warps (its two accumulators)."""
    if pair:
        return SkinnyConfig(16, min(256, max(16, triton.next_power_of_2(k))), 1, num_warps=4, use_dot=False)
    block_k = min(512, max(16, triton.next_power_of_2(k)))
    warps = 2 if n * k <= 8 << 20 else 4
    return SkinnyConfig(8, block_k, 1, num_warps=warps, num_stages=3, use_dot=False)


def _one_load_row(k: int, num_warps: int) -> int:
    """The padded row the mean square loads at once where it keeps to 64 elements a thread (x and
    the residual: 64 registers of 16-bit pairs), else 0 (a loop over BLOCK_K steps)."""
    row = triton.next_power_of_2(k)
    return row if row <= 64 * 32 * num_warps else 0


@triton.jit
def _normed(X, R, NW, ks, km, rstd, HAS_RES: tl.constexpr):  # type: ignore[no-untyped-def]
    # h[ks] in x's dtype, as fused_ops.rms_norm stores it
    xr = tl.load(X + ks, mask=km, other=0.0)
    if HAS_RES:
        xr = xr + tl.load(R + ks, mask=km, other=0.0)
    nw = tl.load(NW + ks, mask=km, other=0.0)
    return nw * (xr.to(tl.float32) * rstd).to(xr.dtype)


@triton.jit
def _rope_out(g, u, head, j, CS, SLOT, QO, KO, VO, KC, VC, NH, NKV, HALF: tl.constexpr):  # type: ignore[no-untyped-def]
    # g, u: fp32 sums of rows j and j + HALF of `head` (q heads, then k, then v). Rounded to the
    # activation dtype as the projection's output is, then what fused_ops.rope_and_cache does:
    # q and k rotated (halves convention) in fp32; k and v also to the cache slot
    dt = QO.dtype.element_ty
    x1 = g.to(dt).to(tl.float32)
    x2 = u.to(dt).to(tl.float32)
    d = 2 * HALF
    if head < NH + NKV:
        cos = tl.load(CS + j)
        sin = tl.load(CS + HALF + j)
        o1 = (x1 * cos - x2 * sin).to(dt)
        o2 = (x2 * cos + x1 * sin).to(dt)
        if head < NH:
            tl.store(QO + head * d + j, o1)
            tl.store(QO + head * d + HALF + j, o2)
        else:
            at = (head - NH) * d + j
            cache = KC + tl.load(SLOT) * NKV * d + at
            tl.store(KO + at, o1)
            tl.store(KO + at + HALF, o2)
            tl.store(cache, o1)
            tl.store(cache + HALF, o2)
    else:
        at = (head - NH - NKV) * d + j
        cache = VC + tl.load(SLOT) * NKV * d + at
        tl.store(VO + at, x1.to(dt))
        tl.store(VO + at + HALF, x2.to(dt))
        tl.store(cache, x1.to(dt))
        tl.store(cache + HALF, x2.to(dt))


@triton.jit
def _norm_skinny_kernel(  # type: ignore[no-untyped-def]
    X,
    R,
    RO,
    NW,
    W,
    B,
    Y,
    K,
    N_OUT,  # outputs: N, or I with PAIR (W then holds 2 I rows)
    eps,
    CS,  # ROPE: the row's cos | sin [D] (float32), its cache slot, q / k / v outputs, the caches
    SLOT,
    QO,
    KO,
    VO,
    KC,
    VC,
    NH,
    NKV,
    HAS_RES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PAIR: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    STAGES: tl.constexpr,
    ROW: tl.constexpr,  # > 0: K padded to a power of two, the mean square in one load; 0: a loop
    ROPE: tl.constexpr = False,  # q|k|v rows, rotated and written out (HALF: head_dim / 2)
    HALF: tl.constexpr = 1,
    WAIT_PRIOR: tl.constexpr = False,
):
    pid = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    if ROPE:  # BLOCK_N rotation pairs of one head: rows j and j + HALF of it (HALF % BLOCK_N == 0)
        head = (pid * BLOCK_N) // HALF
        j0 = (pid * BLOCK_N) % HALF
        n0 = head * 2 * HALF + j0
        second = n0 + HALF
        n_mask = offs_n < BLOCK_N
    else:
        n0 = pid * BLOCK_N
        second = N_OUT + n0
        n_mask = n0 + offs_n < N_OUT
    TWO: tl.constexpr = PAIR or ROPE
    g_rows = W + n0.to(tl.int64) * K
    u_rows = W + second.to(tl.int64) * K
    # weights: no kernel of a step writes them, so their first tiles load before the wait
    wg = _w_tile(g_rows, K, offs_n, n_mask, 0, K, BLOCK_K, EVEN_K)
    if TWO:
        wu = _w_tile(u_rows, K, offs_n, n_mask, 0, K, BLOCK_K, EVEN_K)
    if WAIT_PRIOR:  # launched with PDL (model/launch.py): x and the residual after the kernel before
        tl.extra.cuda.gdc_wait()
    offs_k = tl.arange(0, BLOCK_K)
    if ROW > 0:  # the whole row in one load: one memory round trip before the weights stream
        kr = tl.arange(0, ROW)
        kr_ok = kr < K
        xr = tl.load(X + kr, mask=kr_ok, other=0.0)
        if HAS_RES:
            xr = xr + tl.load(R + kr, mask=kr_ok, other=0.0)  # in the activation dtype, as rms_norm
            if pid == 0:
                tl.store(RO + kr, xr, mask=kr_ok)
        xf = xr.to(tl.float32)
        ss = xf * xf
    else:
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs_k
            km = ks < K
            xr = tl.load(X + ks, mask=km, other=0.0)
            if HAS_RES:
                xr = xr + tl.load(R + ks, mask=km, other=0.0)
                if pid == 0:
                    tl.store(RO + ks, xr, mask=km)
            xf = xr.to(tl.float32)
            ss += xf * xf
    rstd = tl.rsqrt(tl.sum(ss, 0) / K + eps)
    h = _normed(X, R, NW, offs_k, offs_k < K, rstd, HAS_RES).to(tl.float32)[None, :]
    acc_g = wg.to(tl.float32) * h
    if TWO:
        acc_u = wu.to(tl.float32) * h
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        ks = k0 + offs_k
        wg = _w_tile(g_rows, K, offs_n, n_mask, k0, K, BLOCK_K, EVEN_K)
        if TWO:
            wu = _w_tile(u_rows, K, offs_n, n_mask, k0, K, BLOCK_K, EVEN_K)
        h = _normed(X, R, NW, ks, ks < K, rstd, HAS_RES).to(tl.float32)[None, :]
        acc_g += wg.to(tl.float32) * h
        if TWO:
            acc_u += wu.to(tl.float32) * h
    cols = n0 + offs_n
    g = tl.sum(acc_g, 1)
    if ROPE:
        u = tl.sum(acc_u, 1)
        if HAS_BIAS:
            g = g + tl.load(B + cols).to(tl.float32)
            u = u + tl.load(B + second + offs_n).to(tl.float32)
        _rope_out(g, u, head, j0 + offs_n, CS, SLOT, QO, KO, VO, KC, VC, NH, NKV, HALF)
    elif PAIR:
        gq = g.to(Y.dtype.element_ty).to(tl.float32)
        u = tl.sum(acc_u, 1).to(Y.dtype.element_ty)
        tl.store(Y + cols, (gq / (1.0 + tl.exp(-gq))).to(Y.dtype.element_ty) * u, mask=n_mask)
    else:
        if HAS_BIAS:
            g = g + tl.load(B + cols, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(Y + cols, g.to(Y.dtype.element_ty), mask=n_mask)


def check_args(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pair: bool,
) -> None:
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2:
        raise ValueError(
            f"x must be one row [1, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    k, n = x.shape[1], weight.shape[0]
    if k == 0:
        raise ValueError("x must have at least one column (the norm's mean square)")
    if weight.shape[1] != k or norm_weight.shape != (k,):
        raise ValueError(
            f"x has K={k}, weight {tuple(weight.shape)} and the norm weight {tuple(norm_weight.shape)}"
        )
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must be shaped as x {tuple(x.shape)}, got {tuple(residual.shape)}")
    tensors = [t for t in (x, residual, norm_weight, weight, bias) if t is not None]
    if x.dtype not in DTYPES or any(t.dtype != x.dtype for t in tensors):
        raise ValueError(f"all tensors must share one of {DTYPES}, got {[t.dtype for t in tensors]}")
    if any(t.device != x.device for t in tensors):
        raise ValueError("all tensors must be on one device")
    if pair and (n % 2 or bias is not None):
        raise ValueError(f"pair takes a gate | up weight of an even row count and no bias, got N={n}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")


def norm_linear_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    pair: bool = False,
    config: SkinnyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-torch twin (config is ignored), rounding where the kernel rounds."""
    check_args(x, residual, norm_weight, weight, bias, pair)
    r = x + residual if residual is not None else x
    rf = r.float()
    h = norm_weight * (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = h.float() @ weight.float().T
    if bias is not None:
        y += bias.float()
    y = y.to(x.dtype)
    if pair:
        g, u = y.chunk(2, dim=-1)
        gf = g.float()
        y = (gf / (1.0 + torch.exp(-gf))).to(x.dtype) * u
    return y, r


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    pair: bool = False,
    config: SkinnyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [1, K]; norm_weight: [K]; weight: [N, K] ([2I, K] gate | up with `pair`); bias:
    [N] | None -> (y [1, N] or [1, I], x + residual, or x itself without a residual). config: a
    SkinnyConfig of one row (block_n, block_k, num_warps, num_stages; default_config when None)."""
    check_args(x, residual, norm_weight, weight, bias, pair)
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    norm_weight, weight = norm_weight.contiguous(), weight.contiguous()
    k, n = x.shape[1], weight.shape[0]
    n_out = n // 2 if pair else n
    y = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    ro = torch.empty_like(x) if residual is not None else x
    if n_out == 0:
        if residual is not None:
            torch.add(x, residual, out=ro)
        return y, ro
    cfg = config or default_config(n, k, pair)
    run_kernel(
        (triton.cdiv(n_out, cfg.block_n),),
        cfg,
        x,
        residual,
        ro,
        norm_weight,
        eps,
        weight,
        bias,
        y,
        n_out,
        pair,
    )
    return y, ro


def run_kernel(
    grid: tuple[int],
    cfg: SkinnyConfig,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    ro: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    n_out: int,
    pair: bool,
    rope: tuple[torch.Tensor, ...] = (),
    heads: tuple[int, int, int] = (0, 0, 1),
) -> None:
    """The launch of norm_linear (rope empty) or of skinny_norm_rope.norm_qkv_rope (rope: cos | sin,
    slot, q / k / v outputs, caches; heads: q heads, kv heads, head_dim / 2), arguments checked."""
    k = x.shape[1]
    _norm_skinny_kernel[grid](
        x,
        residual if residual is not None else x,
        ro,
        norm_weight,
        weight,
        bias if bias is not None else weight,
        y,
        k,
        n_out,
        eps,
        *(rope or [x] * 7),  # without RoPE: CS, SLOT, QO, KO, VO, KC, VC are not read
        heads[0],
        heads[1],
        HAS_RES=residual is not None,
        HAS_BIAS=bias is not None,
        PAIR=pair,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0,
        STAGES=cfg.num_stages,
        ROW=_one_load_row(k, cfg.num_warps),
        ROPE=bool(rope),
        HALF=heads[2],
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(x.device),
    )
