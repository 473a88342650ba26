"""Launch options of the Triton LoRA ops: choices of kernel variant that change how fast a launch
runs, never what it computes. One frozen value, passed to `add_lora` by keyword; the worker builds
it once for its device (`LaunchOptions.for_device`), benchmarks sweep it with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LaunchOptions:
    # Programmatic dependent launch of add_lora's expand (Hopper and later): its programs start
    # while the shrink runs, load their work items, B and y tiles, then wait for the shrink's
    # partial sums, so a decode step would pay one launch latency per module group instead of two.
    # Off until measured on a GPU (benchmarks/bench_kernels.py --sweep tries it); taken only where
    # the device and the installed Triton have it.
    pdl: bool = False
    # Load each expand item's first B and y tiles before its s (None: only when launched with PDL).
    expand_preload: bool | None = None
    # B loads of whole 16-byte vectors along the rank (entries past a slot's rank zeroed in
    # registers) instead of element-wise rank masks, which keep the compiler to 2-byte loads.
    b_vector_loads: bool = True

    @classmethod
    def for_device(cls, device: torch.device | str, **overrides: bool | None) -> LaunchOptions:
        """The defaults (with `overrides`) as they can run on `device`: PDL only where the device
        and the installed Triton support it."""
        options = cls(**overrides)  # type: ignore[arg-type]
        if options.pdl and not pdl_supported(torch.device(device)):
            options = dataclasses.replace(options, pdl=False)
        return options


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: a CUDA device of compute capability 9.0+ and a Triton with
    grid dependency control (never under the interpreter)."""
    if device.type != "cuda":
        return False
    from loraserve.kernels import triton_ops

    return triton_ops.pdl_supported(device)
