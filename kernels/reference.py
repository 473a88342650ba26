"""Plain-torch twins of the LoRA ops: same signatures and semantics, used off-CUDA and as test oracle.
Called through kernels.ops, which checks the arguments first.

They loop over the slots present in the batch (a host synchronization per call), compute in float32
and read only A[slot, i, :r] and B[slot, :, :r], r = ranks[slot], never the padding past the rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
from torch.nn import functional as F

from loraserve.kernels.batch import LoRABatch
from loraserve.kernels.launch_options import LaunchOptions


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [L, S, R, in]
    ranks: torch.Tensor,  # [L] int32
    batch: LoRABatch,
    out: torch.Tensor,  # [S, T, R] fp32
) -> torch.Tensor:
    """Semantics: out[i, t, :r] = x[t] @ A[slot[t], i, :r].T for rows with slot >= 0 (r = ranks[slot])."""
    _shrink(x, lora_a, ranks.tolist(), batch.rows_by_slot(), out)
    return out


def lora_expand(
    s: torch.Tensor,  # [S, T, R] fp32
    lora_b: torch.Tensor,  # [L, N, R]
    ranks: torch.Tensor,  # [L] int32
    batch: LoRABatch,
    slice_offsets: Sequence[int],  # S+1 offsets into N
    y: torch.Tensor,  # [T, N]
) -> torch.Tensor:
    """Semantics: y[t, o_i:o_i+1] += s[i, t, :r] @ B[slot[t], o_i:o_i+1, :r].T for rows with slot >= 0."""
    _expand(s, lora_b, ranks.tolist(), batch.rows_by_slot(), list(slice_offsets), y)
    return y


def add_lora(
    y: torch.Tensor,  # [T, N]
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [L, S, R, in]
    lora_b: torch.Tensor,  # [L, N, R]
    ranks: torch.Tensor,  # [L] int32
    batch: LoRABatch,
    slice_offsets: Sequence[int],
    buffer: torch.Tensor | None = None,
    options: LaunchOptions | None = None,
) -> torch.Tensor:
    """Semantics: y[t, o_i:o_i+1] += (x[t] @ A[slot[t], i, :r].T) @ B[slot[t], o_i:o_i+1, :r].T.

    `buffer` and `options` are accepted for the Triton signature and ignored: the intermediate is a freshly
    allocated [S, T, R] float32 tensor."""
    num_tokens = x.shape[0]
    _, num_slices, max_rank, _ = lora_a.shape
    rows_by_slot = batch.rows_by_slot()
    rank_list = ranks.tolist()
    s = torch.empty((num_slices, num_tokens, max_rank), dtype=torch.float32, device=x.device)
    _shrink(x, lora_a, rank_list, rows_by_slot, s)
    _expand(s, lora_b, rank_list, rows_by_slot, list(slice_offsets), y)
    return y


def add_lora_begin(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [L, S, R, in]
    ranks: torch.Tensor,  # [L] int32
    batch: LoRABatch,
    buffer: torch.Tensor | None = None,
    options: LaunchOptions | None = None,
) -> torch.Tensor:
    """add_lora's first half: s [S, T, R] float32 (freshly allocated; buffer and options ignored)."""
    _, num_slices, max_rank, _ = lora_a.shape
    s = torch.zeros((num_slices, x.shape[0], max_rank), dtype=torch.float32, device=x.device)
    _shrink(x, lora_a, ranks.tolist(), batch.rows_by_slot(), s)
    return s


def add_lora_finish(
    begun: torch.Tensor,  # s from add_lora_begin
    y: torch.Tensor,  # [T, N]
    lora_b: torch.Tensor,  # [L, N, R]
    ranks: torch.Tensor,  # [L] int32
    batch: LoRABatch,
    slice_offsets: Sequence[int],
    options: LaunchOptions | None = None,
) -> torch.Tensor:
    """add_lora's second half: y += the delta of `begun`'s s (in place); returns y."""
    _expand(begun, lora_b, ranks.tolist(), batch.rows_by_slot(), list(slice_offsets), y)
    return y


def add_lora_silu_mul(
    y: torch.Tensor,  # [T, 2I] gate | up
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [L, 2, R, in]
    lora_b: torch.Tensor,  # [L, 2I, R]
    ranks: torch.Tensor,  # [L] int32
    batch: LoRABatch,
    out: torch.Tensor,  # [T, I]
    buffer: torch.Tensor | None = None,
    options: LaunchOptions | None = None,
) -> torch.Tensor:
    """Semantics: out = silu(g) * u, with g | u = y + add_lora's delta rounded to y's dtype (y itself
    is not modified); silu in float32, rounded to y's dtype before the product. Returns out."""
    inter = out.shape[1]
    z = add_lora(y.clone(), x, lora_a, lora_b, ranks, batch, [0, inter, 2 * inter])
    gate, up = z.split(inter, dim=-1)
    out.copy_(F.silu(gate.float()).to(z.dtype) * up)
    return out


def _shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    ranks: list[int],
    rows_by_slot: dict[int, torch.Tensor],
    out: torch.Tensor,
) -> None:
    for slot, rows in rows_by_slot.items():
        r = ranks[slot]
        if r <= 0:
            continue
        xs = x[rows].float()  # [n, in]
        for i in range(lora_a.shape[1]):
            out[i, rows, :r] = xs @ lora_a[slot, i, :r].float().T  # [n, r]


def _expand(
    s: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: list[int],
    rows_by_slot: dict[int, torch.Tensor],
    offsets: list[int],
    y: torch.Tensor,
) -> None:
    for slot, rows in rows_by_slot.items():
        r = ranks[slot]
        if r <= 0:
            continue
        for i, (lo, hi) in enumerate(pairwise(offsets)):
            delta = s[i, rows, :r] @ lora_b[slot, lo:hi, :r].float().T  # [n, hi - lo]
            y[rows, lo:hi] = (y[rows, lo:hi].float() + delta).to(y.dtype)
