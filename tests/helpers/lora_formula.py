"""The LoRA formula in float64, one row at a time: the oracle every kernel test compares against."""

from __future__ import annotations

from itertools import pairwise

import torch


def lora_delta64(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [L, S, R, in]
    lora_b: torch.Tensor,  # [L, N, R]
    ranks: list[int],
    slots: list[int],
    offsets: list[int],
) -> torch.Tensor:
    """delta [T, N] float64: row t gets (x[t] @ A[s, i, :r].T) @ B[s, o_i:o_{i+1}, :r].T per slice i."""
    num_tokens, out_features = x.shape[0], lora_b.shape[1]
    delta = torch.zeros(num_tokens, out_features, dtype=torch.float64)
    x64, a64, b64 = x.double().cpu(), lora_a.double().cpu(), lora_b.double().cpu()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        r = ranks[slot]
        for i, (lo, hi) in enumerate(pairwise(offsets)):
            delta[t, lo:hi] = (x64[t] @ a64[slot, i, :r].T) @ b64[slot, lo:hi, :r].T
    return delta


def shrink64(x: torch.Tensor, lora_a: torch.Tensor, ranks: list[int], slots: list[int]) -> torch.Tensor:
    """s [S, T, R] float64, zero past each row's rank and for slot -1 rows."""
    num_slices, max_rank = lora_a.shape[1], lora_a.shape[2]
    s = torch.zeros(num_slices, x.shape[0], max_rank, dtype=torch.float64)
    x64, a64 = x.double().cpu(), lora_a.double().cpu()
    for t, slot in enumerate(slots):
        if slot >= 0:
            r = ranks[slot]
            for i in range(num_slices):
                s[i, t, :r] = a64[slot, i, :r] @ x64[t]
    return s
