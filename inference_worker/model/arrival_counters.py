"""Arrival counters of the model's Triton kernels whose last program to arrive finishes the work
(the skinny GEMM's split-K reduction, model/skinny_gemm.py; the row argmax, model/row_argmax.py).

One persistent zeroed int32 buffer per device, shared by every such launch on it: each launch sets
the counters it used back to 0 before it ends (CUDA-graph replays find them zero), and the launches
sharing it run on one stream (as the worker's model does), never concurrently.
"""

from __future__ import annotations

import torch

MIN_COUNTERS = 16384  # counters allocated at first use on a device (64 KiB)

_counters: dict[torch.device, torch.Tensor] = {}
_retired: list[torch.Tensor] = []  # outgrown buffers: CUDA graphs captured with them still use them


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """The device's zeroed int32 arrival counters, at least `count` of them (grown outside capture)."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{count} arrival counters are needed during CUDA-graph capture; "
                "run the same launch once before capturing"
            )
        if buf is not None:
            _retired.append(buf)
        size = max(count, MIN_COUNTERS, 2 * buf.numel() if buf is not None else 0)
        buf = _counters[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return buf
