"""A Triton "skinny GEMM" for the decode step's narrow projections (few rows, weights streamed once).

    skinny_linear(x [M, K], weight [N, K], bias [N] | None) -> y [M, N], M <= 16:
        y = x @ weight.T (+ bias), fp32 accumulation, each output rounded once to x's dtype

At decode sizes a projection reads N x K weights for a handful of rows: its time is the time to
stream the weights from HBM. The grid covers N in tiles of BLOCK_N weight rows and, optionally,
K in SPLIT_K parts, so that a narrow projection (N of a few thousand) still spreads its bytes over
every SM:

    program (n tile, k part): acc[BLOCK_M, BLOCK_N] = x[:, part] @ w[tile, part].T
    SPLIT_K == 1: y[:, tile] = acc (+ bias), stored by the program itself.
    SPLIT_K > 1:  acc goes to an fp32 workspace [SPLIT_K, M, N]; the program that arrives last at
                  its n tile (an int32 arrival counter per tile, acq_rel atomic add) sums the parts
                  in split order (deterministic), adds the bias, stores y and sets the counter back
                  to 0, so the counters are zero again after every launch (CUDA-graph replays too).

The counters are model/arrival_counters.py's: one persistent zeroed buffer per device, shared by
every launch on it, so the launches sharing it must run on one stream, never concurrently.

The inner product is `tl.dot` of x padded to 16 rows by a w tile (USE_DOT), or per row a
broadcast multiply and sum over K (`tl.sum(w * x[None, :], 1)`), which may be faster for one row.
Launched with programmatic dependent launch (model/launch.py), each program loads its first w tile
(weights: no kernel of a step writes them) before it waits for the kernel before it; x, the
workspace, the counters and y only after. Every program waits, so a kernel after this one that
waits for it also waits for everything before it.

`default_config` is a first guess for Hopper-class GPUs; benchmarks/bench_skinny_gemm.py sweeps the
configurations against cuBLAS on a GPU, which is where the final values come from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraserve.inference_worker.model.arrival_counters import arrival_counters
from loraserve.inference_worker.model.launch import pdl_launch
from loraserve.kernels.launch_options import multiprocessors

# Kernel parameters stay unannotated (type: ignore[no-untyped-def]): Triton reads a parameter's
# annotation as a specialization hint, so a type there would change the compiled kernel.

MAX_ROWS = 16
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class SkinnyConfig:
    """Tiles and launch options of one skinny_linear launch (they change the speed, never the result
    beyond fp32 summation order)."""

    block_n: int = 16  # weight rows per program
    block_k: int = 256  # K elements per loop step
    split_k: int = 1  # K parts per n tile (> 1: workspace and last-arriver reduction)
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = True  # tl.dot of x padded to 16 rows; False: broadcast multiply and sum per row

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.use_dot and (self.block_n < 16 or self.block_k < 16):
            raise ValueError(f"use_dot needs block_n and block_k >= 16, got {self}")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"split_k, num_warps and num_stages must be >= 1, got {self}")


def default_config(m: int, n: int, k: int, num_sms: int) -> SkinnyConfig:
    """A first guess for 16-bit weights: a grid of at least one program per SM (1-2 for the narrow
    projections), each reading >= ~32 KB of w.

    block_n: the widest of 64, 32, 16 that still gives every SM an n tile; below that (a narrow N)
    16 rows, and K split in two, four, ... while the grid is under one program per SM and each part
    keeps >= 1024 elements of K (32 KB of w). block_k: a w tile of ~16 KB per loop step. One row:
    the broadcast multiply and sum; more: tl.dot.

    One row takes what the sweep measured fastest on an H200 for every narrow projection of the
    1B and 8B shapes (benchmarks/results/skinny_gemm_h200_2026-11-29.md): 8 weight rows a program,
    512 of K a step, no split, 2 warps up to 8M weights and 4 above."""
    if m == 1:
        block_k = min(512, max(16, triton.next_power_of_2(k)))
        return SkinnyConfig(
            8, block_k, 1, num_warps=2 if n * k <= 8 << 20 else 4, num_stages=3, use_dot=False
        )
    block_n = next((b for b in (64, 32) if triton.cdiv(n, b) >= num_sms), 16)
    tiles, split = triton.cdiv(n, block_n), 1
    while tiles * split < num_sms and k // (2 * split) >= 1024:
        split *= 2
    block_k = min(max(16384 // (2 * block_n), 64), 512, max(16, triton.next_power_of_2(k // split)))
    return SkinnyConfig(block_n, block_k, split, num_warps=4, num_stages=3, use_dot=m > 1)


@triton.jit
def _w_tile(W, K, offs_n, n_mask, k0, k_hi, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):  # type: ignore[no-untyped-def]
    # W points at the tile's first row: -> w[BLOCK_N, BLOCK_K] at columns k0.., zero past k_hi
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = W + offs_n[:, None] * K + offs_k[None, :]
    if EVEN_K:
        return tl.load(ptrs, mask=n_mask[:, None], other=0.0)
    return tl.load(ptrs, mask=n_mask[:, None] & (offs_k < k_hi)[None, :], other=0.0)


@triton.jit
def _mac(  # type: ignore[no-untyped-def]
    acc,
    X,
    s_xm,
    M,
    w,
    k0,
    k_hi,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
):
    # acc[BLOCK_M, BLOCK_N] += x[:, k0:k0 + BLOCK_K] @ w.T (one row without tl.dot: acc [BLOCK_N,
    # BLOCK_K] += w * x, summed by the caller); rows past M repeat row M - 1 (their sums are never
    # stored), columns past k_hi are zero
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if USE_DOT:
        rows = tl.minimum(tl.arange(0, BLOCK_M), M - 1)
        ptrs = X + rows[:, None] * s_xm + offs_k[None, :]
        if EVEN_K:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=(offs_k < k_hi)[None, :], other=0.0)
        if IEEE:  # float32: exact products, not TF32
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    elif BLOCK_M == 1:  # one row: acc [BLOCK_N, BLOCK_K] of products, summed over K after the loop
        ptrs = X + offs_k
        if EVEN_K:
            xr = tl.load(ptrs)
        else:
            xr = tl.load(ptrs, mask=offs_k < k_hi, other=0.0)
        acc += w.to(tl.float32) * xr.to(tl.float32)[None, :]
    else:
        wf = w.to(tl.float32)
        rows = tl.arange(0, BLOCK_M)[:, None]
        for r in tl.static_range(BLOCK_M):
            ptrs = X + tl.minimum(r, M - 1) * s_xm + offs_k
            if EVEN_K:
                xr = tl.load(ptrs)
            else:
                xr = tl.load(ptrs, mask=offs_k < k_hi, other=0.0)
            part = tl.sum(wf * xr.to(tl.float32)[None, :], 1)  # [BLOCK_N]
            acc = tl.where(rows == r, acc + part[None, :], acc)
    return acc


@triton.jit
def _store_y(Y, B, s_ym, M, N, acc, offs_n, n_mask, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr):  # type: ignore[no-untyped-def]
    if HAS_BIAS:
        acc = acc + tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    rows = tl.arange(0, BLOCK_M)
    mask = (rows < M)[:, None] & n_mask[None, :]
    tl.store(Y + rows[:, None] * s_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _skinny_kernel(  # type: ignore[no-untyped-def]
    X,
    W,
    B,
    Y,
    WS,
    CNT,
    M,
    N,
    K,
    K_PART,
    SPLIT_K,
    s_xm,
    s_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
    STAGES: tl.constexpr,
    WAIT_PRIOR: tl.constexpr = False,
):
    # grid (cdiv(N, BLOCK_N), SPLIT_K); K_PART: K elements per part, a multiple of BLOCK_K; SPLIT:
    # SPLIT_K > 1 (the number of parts itself is not compiled in: one kernel serves every split)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = n0 + offs_n < N
    k_lo = pid_k * K_PART
    k_hi = tl.minimum(k_lo + K_PART, K)
    w_rows = W + n0.to(tl.int64) * K
    w = _w_tile(w_rows, K, offs_n, n_mask, k_lo, k_hi, BLOCK_K, EVEN_K)  # a weight: read before the wait
    if WAIT_PRIOR:  # launched with PDL (model/launch.py): x, stores and atomics after the kernel before
        tl.extra.cuda.gdc_wait()
    ROW_SUMS: tl.constexpr = not USE_DOT and BLOCK_M == 1
    if ROW_SUMS:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = _mac(acc, X, s_xm, M, w, k_lo, k_hi, BLOCK_M, BLOCK_K, EVEN_K, USE_DOT, IEEE)
    # num_stages on the loop itself: the w loads are pipelined also where no tl.dot takes them
    for k0 in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=STAGES):
        w = _w_tile(w_rows, K, offs_n, n_mask, k0, k_hi, BLOCK_K, EVEN_K)
        acc = _mac(acc, X, s_xm, M, w, k0, k_hi, BLOCK_M, BLOCK_K, EVEN_K, USE_DOT, IEEE)
    if ROW_SUMS:
        acc = tl.sum(acc, 1)[None, :]
    cols = n0 + offs_n
    if not SPLIT:
        _store_y(Y, B, s_ym, M, N, acc, cols, n_mask, BLOCK_M, HAS_BIAS)
    else:
        rows = tl.arange(0, BLOCK_M)
        part = rows[:, None] * N + cols[None, :]  # [BLOCK_M, BLOCK_N] offsets in one [M, N] part
        mask = (rows < M)[:, None] & n_mask[None, :]
        tl.store(WS + pid_k * M * N + part, acc, mask=mask)
        tl.debug_barrier()  # every thread's part stored before the arrival is published
        arrived = tl.atomic_add(CNT + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last part of this n tile: sum the parts in split order
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(WS + s * M * N + part, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(CNT + pid_n, 0)  # zero again for the next launch
            _store_y(Y, B, s_ym, M, N, total, cols, n_mask, BLOCK_M, HAS_BIAS)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {x.shape[0]}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has K={x.shape[1]} but weight has K={weight.shape[1]}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one of {DTYPES}, got {x.dtype} and {weight.dtype}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous (row-major [N, K], as nn.Linear.weight)")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(
            f"bias must be [{weight.shape[0]}] of {x.dtype}, got {tuple(bias.shape)} {bias.dtype}"
        )
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError("x, weight and bias must be on one device")


def skinny_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """The plain-torch twin of skinny_linear (config is ignored): fp32 products and sums, rounded once."""
    _check(x, weight, bias)
    y = x.float() @ weight.float().T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x: [M, K] (M <= 16, unit column stride, else copied), weight: [N, K] contiguous, bias: [N] |
    None -> y [M, N] in x's dtype. config: default_config for the shape and device when None."""
    _check(x, weight, bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.copy_(bias.expand(m, n)) if bias is not None else y.zero_()
    cfg = config or default_config(m, n, k, multiprocessors(x.device))
    k_tiles = triton.cdiv(k, cfg.block_k)
    per_part = triton.cdiv(k_tiles, min(cfg.split_k, k_tiles))
    split = triton.cdiv(k_tiles, per_part)  # every part holds at least one K tile
    tiles = triton.cdiv(n, cfg.block_n)
    if split > 1:
        ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device, tiles)
    else:
        ws = counters = y  # not read
    _skinny_kernel[(tiles, split)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        ws,
        counters,
        m,
        n,
        k,
        per_part * cfg.block_k,
        split,
        x.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=MAX_ROWS if cfg.use_dot else triton.next_power_of_2(m),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT=split > 1,
        EVEN_K=k % cfg.block_k == 0,
        USE_DOT=cfg.use_dot,
        IEEE=x.dtype == torch.float32,
        STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(x.device),
    )
    return y
