"""Multi-LoRA kernels: every row of a batch gets the LoRA delta of its own adapter slot.

Semantics, for each row t with slot[t] >= 0 and each output slice i of a module group:

    y[t, o_i:o_{i+1}] += (x[t] @ A[slot[t], i, :r].T) @ B[slot[t], o_i:o_{i+1}, :r].T,  r = ranks[slot[t]]

split into `lora_shrink` (x -> s, fp32) and `lora_expand` (s -> y, in place), or both in `add_lora`
(also in two calls, `add_lora_begin` and `add_lora_finish`, for a shrink beside y's producer);
`add_lora_silu_mul` is add_lora on a gate | up pair followed by silu(gate) * up, in one expand.
`LoRABatch` holds the per-step metadata (rows grouped by slot, work lists) shared by every layer;
`LaunchOptions` picks Triton kernel variants (PDL, preloading, vector loads), passed by keyword.
Triton kernels run on CUDA tensors; a plain-torch twin of each op (kernels.reference) elsewhere.
"""

from loraserve.kernels.batch import LoRABatch
from loraserve.kernels.launch_options import LaunchOptions
from loraserve.kernels.ops import (
    LoRABegun,
    add_lora,
    add_lora_begin,
    add_lora_finish,
    add_lora_silu_mul,
    lora_expand,
    lora_shrink,
)

__all__ = [
    "LaunchOptions",
    "LoRABatch",
    "LoRABegun",
    "add_lora",
    "add_lora_begin",
    "add_lora_finish",
    "add_lora_silu_mul",
    "lora_expand",
    "lora_shrink",
]
