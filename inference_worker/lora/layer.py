"""The LoRA object attached to one grouped projection (model/linear.py GroupedLinear.lora).

Semantics, for every row t whose sequence's adapter sits in slot s = token_slots[t] >= 0 and each
slice i of the group (r = rank of slot s for this layer and group):

    y[t, off_i : off_i + n_i] += (x[t] @ A[s, i, :r].T) @ B[s, off_i : off_i + n_i, :r].T

Rows with slot -1 (base model) are untouched. The kernels of `kernels/` do the work: Triton on
CUDA, their plain-torch reference elsewhere.
"""

from __future__ import annotations

import itertools

import torch

from loraserve import kernels
from loraserve.inference_worker.lora.slots import LoRASlots
from loraserve.kernels.launch_plan import fuse_silu_mul_pays


def worker_launch_options(device: torch.device | str) -> kernels.LaunchOptions:
    """The worker's launch options: the defaults for `device`, and the shrink launched with PDL
    too. A LoRALayer's add_lora always follows its base projection (cuBLAS's GEMM, or the skinny
    GEMM, which lets the next kernel start only as its programs end, after their wait), which reads
    x, while the slots and the step's LoRABatch were written before: LaunchOptions.pdl_shrink's
    contract."""
    return kernels.LaunchOptions.for_device(device, pdl_shrink=True)


class LoRALayer:
    def __init__(
        self,
        slots: LoRASlots,
        layer: int,
        group: str,
        options: kernels.LaunchOptions | None = None,
        side_stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.layer, self.group = layer, group
        self.options = options if options is not None else kernels.LaunchOptions()
        # With a side stream (CUDA), the shrink runs there beside the base projection's GEMM
        # (kernels.add_lora_begin, split over K as add_lora splits it) and the expand follows both
        # on the main stream (add_lora_finish, PDL-launched after the GEMM where the options say);
        # without, shrink and expand launch together after the GEMM (`add_lora`).
        self.side_stream = side_stream
        self.lora_a = slots.a[layer][group]  # [L, S, R, in]
        self.lora_b = slots.b[layer][group]  # [L, N, R]
        self.ranks = slots.group_ranks(layer, group)  # [L] int32
        self.slice_offsets = list(itertools.accumulate(slots.out_sizes[group], initial=0))  # [S + 1]

    def begin(self, x: torch.Tensor, lora: kernels.LoRABatch) -> kernels.LoRABegun | None:
        """With a side stream: the shrink of x into the batch's workspace, launched there after
        everything queued so far on x's stream (None without a side stream)."""
        if self.side_stream is None:
            return None
        self.side_stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(self.side_stream):
            return kernels.add_lora_begin(x, self.lora_a, self.ranks, lora, options=self.options)

    def finish(self, x: torch.Tensor, y: torch.Tensor, lora: kernels.LoRABatch, begun: object) -> None:
        # x: [T, in], y: [T, N] (added to in place); begun: what `begin` returned. With the
        # worker's options (worker_launch_options) the kernel queued right before this call may
        # write y but not x, the slots or the batch: in the model it is the base GEMM.
        if isinstance(begun, kernels.LoRABegun) and self.side_stream is not None:
            torch.cuda.current_stream(y.device).wait_stream(self.side_stream)
            kernels.add_lora_finish(
                begun, y, self.lora_b, self.ranks, lora, self.slice_offsets, options=self.options
            )
            return
        kernels.add_lora(
            y, x, self.lora_a, self.lora_b, self.ranks, lora, self.slice_offsets, options=self.options
        )

    def fuses_silu_mul(self, num_tokens: int) -> bool:
        """Whether `silu_mul` serves this layer for a step of `num_tokens` rows: a gate | up pair,
        no side stream, and the option on (None: where it measured faster, launch_plan)."""
        if self.side_stream is not None or len(self.slice_offsets) != 3:
            return False
        fuse = self.options.fused_silu_mul
        return fuse_silu_mul_pays(num_tokens) if fuse is None else fuse

    def silu_mul(self, x: torch.Tensor, y: torch.Tensor, lora: kernels.LoRABatch) -> torch.Tensor:
        """For the gate | up group (where `fuses_silu_mul`): silu(gate) * up of y plus each row's delta,
        y left as it was (kernels.add_lora_silu_mul: one expand that writes the activation). Same
        ordering contract as `finish`."""
        out = torch.empty((y.shape[0], y.shape[1] // 2), dtype=y.dtype, device=y.device)
        return kernels.add_lora_silu_mul(
            y, x, self.lora_a, self.lora_b, self.ranks, lora, out, options=self.options
        )

    def apply(self, x: torch.Tensor, y: torch.Tensor, lora: kernels.LoRABatch) -> None:
        """y += the delta of each row's adapter, after y exists (no overlap)."""
        self.finish(x, y, lora, None)

    def __repr__(self) -> str:
        return f"LoRALayer(layer={self.layer}, group={self.group}, slots={self.lora_a.shape[0]})"
