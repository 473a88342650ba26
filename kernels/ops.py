"""Public LoRA ops: Triton on CUDA tensors, the plain-torch twin (kernels.reference) elsewhere.

`backend` picks explicitly: "triton" also runs on CPU tensors when TRITON_INTERPRET=1 was set before
the kernels were imported (the Triton interpreter); "reference" always runs the torch twin.
Arguments are checked here, once, before either backend runs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType

import torch

from loraserve.kernels import reference
from loraserve.kernels.batch import LoRABatch
from loraserve.kernels.checks import (
    check_add_lora,
    check_expand,
    check_expand_inputs,
    check_shrink,
    check_shrink_inputs,
    check_silu_mul_out,
    check_slice_limit,
)
from loraserve.kernels.launch_options import LaunchOptions

BACKENDS = ("triton", "reference")


def _backend(t: object, backend: str | None) -> ModuleType:
    if backend is None:
        backend = "triton" if isinstance(t, torch.Tensor) and t.is_cuda else "reference"
    if backend == "reference":
        return reference
    if backend != "triton":
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if isinstance(t, torch.Tensor) and not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before import")
    from loraserve.kernels import triton_ops

    return triton_ops


def lora_shrink(
    x: torch.Tensor,  # [T, in] fp16/bf16/fp32
    lora_a: torch.Tensor,  # [L, S, R, in], x's dtype
    ranks: torch.Tensor,  # [L] int32, rank of each slot for this module group (0 = unused)
    batch: LoRABatch,
    out: torch.Tensor,  # [S, T, R] fp32
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Semantics: out[i, t, :r] = x[t] @ A[slot[t], i, :r].T, fp32 accumulation, r = ranks[slot[t]].

    Written only for rows with slot >= 0 and only its first r columns; returns out."""
    impl = _backend(x, backend)
    check_shrink(x, lora_a, ranks, batch, out)
    return impl.lora_shrink(x, lora_a, ranks, batch, out)


def lora_expand(
    s: torch.Tensor,  # [S, T, R] fp32 from lora_shrink
    lora_b: torch.Tensor,  # [L, N, R], y's dtype
    ranks: torch.Tensor,  # [L] int32
    batch: LoRABatch,
    slice_offsets: Sequence[int],  # S+1 host ints: slice i owns columns o_i:o_{i+1} of N
    y: torch.Tensor,  # [T, N]
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Semantics: y[t, o_i:o_{i+1}] += s[i, t, :r] @ B[slot[t], o_i:o_{i+1}, :r].T (in place).

    Rows with slot -1 are untouched; returns y."""
    impl = _backend(s, backend)
    offsets = check_expand(s, lora_b, ranks, batch, slice_offsets, y)
    if impl is not reference:
        check_slice_limit(len(offsets) - 1, impl.MAX_SLICES)
    return impl.lora_expand(s, lora_b, ranks, batch, offsets, y)


def add_lora(
    y: torch.Tensor,  # [T, N]
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [L, S, R, in]
    lora_b: torch.Tensor,  # [L, N, R]
    ranks: torch.Tensor,  # [L] int32
    batch: LoRABatch,
    slice_offsets: Sequence[int],
    buffer: torch.Tensor | None = None,  # fp32 workspace; default batch.workspace
    *,
    backend: str | None = None,
    options: LaunchOptions | None = None,  # Triton launch variants; default LaunchOptions()
) -> torch.Tensor:
    """Semantics: y[t, o_i:o_{i+1}] += (x[t] @ A[slot[t], i, :r].T) @ B[slot[t], o_i:o_{i+1}, :r].T.

    Shrink then expand; the intermediate lives in `buffer` (or the batch's workspace), so nothing is
    allocated. With `options.pdl_shrink`, the inputs other than y must have been complete before the
    kernel queued right before this call started (LaunchOptions). Returns y."""
    impl = _backend(x, backend)
    _, num_slices, _, offsets = check_add_lora(y, x, lora_a, lora_b, ranks, batch, slice_offsets)
    if impl is not reference:
        check_slice_limit(num_slices, impl.MAX_SLICES)
    return impl.add_lora(y, x, lora_a, lora_b, ranks, batch, offsets, buffer, options=options)


class LoRABegun:
    """add_lora's shrink in flight (`add_lora_begin`), for `add_lora_finish`."""

    def __init__(self, impl: ModuleType, state: object, lora_a: torch.Tensor, batch: LoRABatch) -> None:
        self.impl, self.state, self.batch = impl, state, batch
        self.num_loras, self.num_slices, self.max_rank = lora_a.shape[:3]
        self.finished = False


def add_lora_begin(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [L, S, R, in]
    ranks: torch.Tensor,  # [L] int32
    batch: LoRABatch,
    buffer: torch.Tensor | None = None,  # fp32 workspace; default batch.workspace
    *,
    backend: str | None = None,
    options: LaunchOptions | None = None,
) -> LoRABegun:
    """add_lora in two calls: this one launches the shrink of x into the workspace (split over K
    as add_lora splits it), `add_lora_finish` the expand into y. Between them the caller may run
    y's producer, on another stream than the shrink's, so that both run at once; it must order the
    finish after both (a stream wait for the shrink's stream), and may not reuse the workspace in
    between. add_lora_begin(...) then add_lora_finish(...) computes what add_lora computes."""
    impl = _backend(x, backend)
    _, num_slices, _ = check_shrink_inputs(x, lora_a, ranks, batch)
    if impl is not reference:
        check_slice_limit(num_slices, impl.MAX_SLICES)
        from loraserve.kernels import triton_two_calls as impl
    state = impl.add_lora_begin(x, lora_a, ranks, batch, buffer, options=options)
    return LoRABegun(impl, state, lora_a, batch)


def add_lora_finish(
    begun: LoRABegun,
    y: torch.Tensor,  # [T, N]
    lora_b: torch.Tensor,  # [L, N, R]
    ranks: torch.Tensor,  # [L] int32
    batch: LoRABatch,
    slice_offsets: Sequence[int],
    *,
    options: LaunchOptions | None = None,
) -> torch.Tensor:
    """The second half of add_lora (see add_lora_begin): y += each row's delta, in place; returns y.
    With PDL where supported, launched right after y's producer on y's stream: it reads y only
    after waiting for that kernel."""
    if not isinstance(begun, LoRABegun):
        raise TypeError(f"begun must be what add_lora_begin returned, got {type(begun).__name__}")
    if begun.finished:
        raise ValueError("this add_lora_begin was finished already (its delta would be added twice)")
    if batch is not begun.batch:
        raise ValueError("add_lora_finish must get the batch its add_lora_begin got")
    # y's rows: checked against the batch, the one x was checked against
    offsets = check_expand_inputs(lora_b, ranks, batch, slice_offsets, y, begun.num_slices, begun.max_rank)
    if lora_b.shape[0] != begun.num_loras:
        raise ValueError(f"lora_a has {begun.num_loras} slots, lora_b {lora_b.shape[0]}")
    begun.finished = True
    return begun.impl.add_lora_finish(begun.state, y, lora_b, ranks, batch, offsets, options=options)


def add_lora_silu_mul(
    y: torch.Tensor,  # [T, 2I] gate | up of the base projection (read, not modified)
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [L, 2, R, in]
    lora_b: torch.Tensor,  # [L, 2I, R]
    ranks: torch.Tensor,  # [L] int32
    batch: LoRABatch,
    out: torch.Tensor,  # [T, I], y's dtype
    buffer: torch.Tensor | None = None,  # fp32 workspace; default batch.workspace
    *,
    backend: str | None = None,
    options: LaunchOptions | None = None,
) -> torch.Tensor:
    """Semantics: out = silu(g) * u where g | u = y + add_lora's delta (slices [0, I) and [I, 2I)),
    each rounded to y's dtype, silu computed in float32 and rounded before the product: what
    add_lora followed by a silu-and-multiply computes, with y left as it was. The Triton backend
    does it in one pass over y after the shrink (the expand writes the activation), so the model's
    MLP saves a kernel and a read and write of y per layer. Same `options` contract as add_lora.
    Returns out."""
    impl = _backend(x, backend)
    inter = check_silu_mul_out(y, out)
    check_add_lora(y, x, lora_a, lora_b, ranks, batch, [0, inter, 2 * inter])
    return impl.add_lora_silu_mul(y, x, lora_a, lora_b, ranks, batch, out, buffer, options=options)
