"""Programmatic dependent launch (PDL, Hopper and later) of the model's own Triton kernels: RMSNorm,
RoPE + KV-cache write, SiLU x up and the paged decode attention's two passes.

A kernel launched with PDL may start while the kernel before it on the stream is still ending (the
last blocks of a cuBLAS GEMM, an attention pass); its programs wait for that kernel (`gdc_wait`)
before they read anything or store anything, so what they compute is what a plain launch computes.
What it saves is the launch latency between two dependent kernels, which is most of a small
kernel's cost in a decode step. Every program waits, also one with nothing to do, so a kernel
launched with PDL after this one (the LoRA expand, the next fused kernel) waiting for it also waits
for everything before it.

On wherever the device and the installed Triton support it (`kernels.launch_options.pdl_supported`);
`set_pdl(False)` turns it off for the launches made after it (a CUDA graph keeps the launches it
captured): benchmarks compare both in one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from loraserve.kernels.launch_options import pdl_supported

_enabled = True


def set_pdl(enabled: bool) -> bool:
    """Whether the model's kernels launched from now on may use PDL; -> the previous setting."""
    global _enabled
    previous, _enabled = _enabled, enabled
    return previous


@contextlib.contextmanager
def pdl_off() -> Iterator[None]:
    """PDL off for the launches (and graph captures) made inside, as it was after."""
    previous = set_pdl(False)
    try:
        yield
    finally:
        set_pdl(previous)


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """The launch keywords of one of the model's kernels on `device`: WAIT_PRIOR (the kernel's
    constexpr: wait for the kernel before it first) and launch_pdl, both on or both left out."""
    if _enabled and pdl_supported(device):
        return {"WAIT_PRIOR": True, "launch_pdl": True}
    return {}
