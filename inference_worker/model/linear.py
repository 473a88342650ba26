"""One projection per adapter-layout group (loraserve/contract/adapter_layout.py GROUPS): qkv (q|k|v fused),
o, gate_up (gate|up fused), down. The LoRA code attaches an object to `lora` by (layer, group);
its `begin(x, lora)` may start work on x before the base projection runs, and its
`finish(x, y, lora, begun)` adds the per-row adapter delta to `y` in place, rows grouped by the
step's `LoRABatch`; for a gate | up projection its `silu_mul` may apply the delta and the
activation at once."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from loraserve.inference_worker.model.forward_batch import ForwardBatch
from loraserve.kernels import LoRABatch

# The base projection of a one-row step on CUDA in a 16-bit dtype runs the skinny GEMM
# (model/skinny_gemm.py) instead of cuBLAS when it has at most this many outputs: on an H200 it
# measured 1.10-1.45x faster for q|k|v, o and down of the 1B and 8B shapes, and 0.98-1.04x for the
# wide gate | up projections (benchmarks/results/skinny_gemm_h200_2026-11-29.md), left to cuBLAS.
SKINNY_MAX_OUT = 8192
# The same steps fold the RMSNorm before q|k|v and gate | up into those projections, RoPE and the
# KV-cache write after q|k|v, SiLU x up after gate | up (model/skinny_norm.py, skinny_norm_rope.py),
# where no LoRA delta is added (`fuses_norm`).
_fuse_norms = True


@contextlib.contextmanager
def norm_fusion_off() -> Iterator[None]:
    """One-row steps keep their norms apart (`fuses_norm` false) inside, as it was after. A captured
    CUDA graph keeps what it captured: benchmarks and tests compare both."""
    global _fuse_norms
    previous, _fuse_norms = _fuse_norms, False
    try:
        yield
    finally:
        _fuse_norms = previous


class NormWeights(Protocol):
    """An RMSNorm's parameters (model/llama.py RMSNorm)."""

    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def eps(self) -> float: ...


class LoraDelta(Protocol):
    def begin(self, x: torch.Tensor, lora: LoRABatch) -> object:
        """Work that needs only x, started before the base projection (None: nothing started);
        its result goes to `finish`."""

    def finish(self, x: torch.Tensor, y: torch.Tensor, lora: LoRABatch, begun: object) -> None:
        """x: [T, in_features], y: [T, out_total]; y += delta of each row's adapter."""

    def fuses_silu_mul(self, num_tokens: int) -> bool:
        """Whether `silu_mul` serves a step of `num_tokens` rows (a gate | up projection only)."""

    def silu_mul(self, x: torch.Tensor, y: torch.Tensor, lora: LoRABatch) -> torch.Tensor:
        """silu(gate) * up of y + each row's delta, y [T, 2I] left as it was -> [T, I]."""


class GroupedLinear(nn.Module):
    def __init__(
        self,
        layer: int,
        group: str,
        in_features: int,
        out_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.layer, self.group = layer, group
        self.in_features, self.out_sizes = in_features, list(out_sizes)
        out_total = sum(out_sizes)
        self.weight = nn.Parameter(
            torch.empty(out_total, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_total, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.lora: LoraDelta | None = None
        self.fusable = torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)
        self.skinny = self.fusable and out_total <= SKINNY_MAX_OUT

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The base projection: x [T, in] -> [T, sum(out_sizes)], no adapter."""
        if self.skinny and x.shape[0] == 1:
            from loraserve.inference_worker.model.skinny_gemm import skinny_linear

            return skinny_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def fuses_norm(self, x: torch.Tensor, batch: ForwardBatch) -> bool:
        """Whether `norm_silu_mul` (gate | up) or Attention.norm_attend (q|k|v) serves this step:
        one row on CUDA in a 16-bit dtype, no LoRA delta to add (a LoRA shrink reads the normed
        input, which the fused kernel keeps to itself)."""
        return _fuse_norms and self.fusable and x.shape[0] == 1 and (self.lora is None or batch.lora is None)

    def norm_silu_mul(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: NormWeights
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For gate | up where `fuses_norm`: silu(gate) * up of project(norm(x + residual)), and
        x + residual, in one kernel (q|k|v's twin, with RoPE: Attention.norm_attend)."""
        from loraserve.inference_worker.model.skinny_norm import norm_linear

        return norm_linear(x, residual, norm.weight, norm.eps, self.weight, self.bias, pair=True)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, in] -> y: [T, sum(out_sizes)]
        if self.lora is None or batch.lora is None:
            return self.project(x)
        begun = self.lora.begin(x, batch.lora)
        y = self.project(x)
        self.lora.finish(x, y, batch.lora, begun)
        return y

    def silu_mul(
        self, x: torch.Tensor, batch: ForwardBatch, activation: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """activation(forward(x)) of a gate | up projection, activation = silu(gate) * up: where
        the LoRA object fuses its delta into the activation (`fuses_silu_mul`), one kernel does
        both after the base GEMM and `activation` is not called."""
        if self.lora is not None and batch.lora is not None and self.lora.fuses_silu_mul(x.shape[0]):
            return self.lora.silu_mul(x, self.project(x), batch.lora)
        return activation(self.forward(x, batch))

    def extra_repr(self) -> str:
        return f"layer={self.layer}, group={self.group}, in={self.in_features}, out={self.out_sizes}"
