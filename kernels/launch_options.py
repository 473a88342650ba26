"""Launch options of the Triton LoRA ops: choices of kernel variant that change how fast a launch
runs, never what it computes. One frozen value, passed to `add_lora` by keyword; the worker builds
it once for its device (`LaunchOptions.for_device`), benchmarks sweep it with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LaunchOptions:
    # Programmatic dependent launch of add_lora's expand (Hopper and later): its programs start
    # while the shrink runs, load their work items, B and y tiles, then wait for the shrink's
    # partial sums, so a decode step pays one launch latency per module group instead of two.
    # None: on wherever the device and the installed Triton support it, where it measured faster
    # (benchmarks/results/overhead.md, H100: a 64-row decode step of rank-16 LoRA on Llama-3-8B
    # shapes 0.93 vs 1.18 ms with 1 adapter, 1.11 vs 1.39 ms with 8, 3.20 vs 3.44 ms with 64).
    pdl: bool | None = None
    # Programmatic dependent launch of add_lora's shrink too (with `pdl`): it starts while the
    # kernel before it on the stream ends, and waits for it only before storing its partial sums;
    # its expand reads y only after its own wait. The caller's contract: everything else add_lora
    # reads (x, A, B, ranks, the batch's work lists) was complete before that kernel let its
    # dependents start: before it started, for a kernel launched plainly (cuBLAS's GEMM), or, for
    # one launched with PDL that triggers nothing early (the model's skinny GEMM of one-row steps),
    # before its own wait returned. So in the model, where the base projection (reading x) comes
    # between (inference_worker's LoRA layers ask for it). Measured (overhead.md, H100): a chain of add_lora calls at 1 adapter
    # 0.66 against 0.92 ms a decode step; the model's decode with a GEMM before each shrink, even.
    pdl_shrink: bool = False
    # Load each expand item's first B and y tiles before its s. None: with PDL, for decode rows
    # whose buffer rank keeps the whole B tile under the preload's tile limit (ranks up to 32 in
    # 16-bit types); it halves the tile at rank 64, which measured slower than not preloading.
    expand_preload: bool | None = None
    # B loads of whole 16-byte vectors along the rank (entries past a slot's rank zeroed in
    # registers) instead of element-wise rank masks, which keep the compiler to 2-byte loads.
    b_vector_loads: bool = True
    # The model's gate | up projection applies its LoRA delta and silu(gate) * up in one expand
    # (add_lora_silu_mul) instead of add_lora's expand and then the activation kernel: one kernel
    # and one read and write of the [T, 2I] projection fewer per layer. None: for steps of
    # FUSED_SILU_MUL_MIN_ROWS rows or more (launch_plan), where it measured faster (H100, 8B
    # gate | up, per layer: T=2048 one adapter 88 -> 33 us of LoRA work, 32 adapters 113 -> 69;
    # at decode sizes it was about even, 1 adapter faster and 32 slower). Read by the worker's
    # LoRA layers (inference_worker/lora/layer.py), not by add_lora.
    fused_silu_mul: bool | None = None

    @classmethod
    def for_device(cls, device: torch.device | str, **overrides: bool | None) -> LaunchOptions:
        """The defaults (with `overrides`) resolved for `device`: PDL on where the device and the
        installed Triton support it (unless overridden off), never where they do not."""
        options = cls(**overrides)  # type: ignore[arg-type]
        supported = pdl_supported(torch.device(device))
        pdl = supported and options.pdl is not False
        return dataclasses.replace(options, pdl=pdl, pdl_shrink=pdl and options.pdl_shrink)


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: a CUDA device of compute capability 9.0+ and a Triton with
    grid dependency control (never under the interpreter)."""
    if device.type != "cuda":
        return False
    from loraserve.kernels import triton_ops

    return triton_ops.pdl_supported(device)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """Multiprocessors of a CUDA device, which grids are sized by; 1 elsewhere (the interpreter runs
    programs one after another: keep its grids tiny)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
