"""Rotary position embeddings in the Hugging Face Llama convention (rotate halves, not pairs)."""

from __future__ import annotations

import torch


def rope_cache(inv_freq: list[float], max_positions: int, device: torch.device | str) -> torch.Tensor:
    """-> [max_positions, d] float32: cos(p * f) | sin(p * f) for f in inv_freq ([d / 2])."""
    f = torch.tensor(inv_freq, dtype=torch.float32, device=device)
    pos = torch.arange(max_positions, dtype=torch.float32, device=device)
    angles = pos[:, None] * f[None, :]  # [P, d/2]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, d], cos_sin: [T, d] -> [T, H, d]; computed in float32, returned in x's dtype."""
    half = x.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
