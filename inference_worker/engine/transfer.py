"""Host values to the device without waiting for it.

`torch.tensor(values, device=cuda)` copies from pageable memory, which waits for everything
queued on the stream: inside a step that is planned while the previous one runs (asynchronous
scheduling) it would wait for that step. These copies go through pinned memory instead; the
pinned buffer is not reused before its copy has run (PyTorch's host allocator tracks that).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A (nested) list of numbers as a tensor on `device`, copied asynchronously on CUDA."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def tensor_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied asynchronously on CUDA."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
