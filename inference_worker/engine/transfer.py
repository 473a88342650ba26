"""Host values to the device without waiting for it.

`torch.tensor(values, device=cuda)` copies from pageable memory, which waits for everything
queued on the stream: inside a step that is planned while the previous one runs (asynchronous
scheduling) it would wait for that step. These copies go through pinned memory instead; the
pinned buffer is not reused before its copy has run (PyTorch's host allocator tracks that, and
`StepInputs`, which carries the runner's per-step tensors in one copy, its own events).
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


def pack(host: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """The bytes of each of `tensors` (CPU, contiguous) into uint8 `host` at its offset. Copied
    through memoryviews: a plain memcpy that keeps the interpreter, where numpy's copies hand it to
    other threads (and the step thread then waits to get it back while the event loop runs)."""
    staged = host.numpy().data
    for t, off in zip(tensors, offsets, strict=True):
        raw = t.reshape(-1).numpy().data.cast("B")  # (a view of a contiguous tensor)
        staged[off : off + raw.nbytes] = raw


class StepInputs:
    """A step's host tensors to the device in one copy, through a ring of pinned buffers that are
    reused once their copy has run: no pinned allocation per step, and two calls a step on the
    step thread (each a point where another thread may take the interpreter), not two a tensor.

    The device copies live in a ring of device buffers too: a step's inputs are overwritten only
    by a copy queued on the same stream after that step."""

    DEPTH = 4

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: list[torch.Tensor | None] = [None] * self.DEPTH
        self._dev: list[torch.Tensor | None] = [None] * self.DEPTH
        self._copied: list[torch.cuda.Event | None] = [None] * self.DEPTH
        self._next = 0

    def to_device(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """`tensors` (CPU, contiguous, of 1-, 4- or 8-byte types) on the device, in order."""
        if self.device.type != "cuda":
            return [t.to(self.device) for t in tensors]
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // 8) * 8  # every tensor 8-byte aligned
        i, self._next = self._next, (self._next + 1) % self.DEPTH
        host, dev, copied = self._host[i], self._dev[i], self._copied[i]
        if copied is not None and not copied.query():
            # the copy out of this buffer DEPTH steps ago is almost always done: asking first
            # keeps the interpreter (query holds it, synchronize hands it to other threads)
            copied.synchronize()
        if host is None or host.numel() < total:
            host = self._host[i] = torch.empty(2 * total, dtype=torch.uint8, pin_memory=True)
            dev = self._dev[i] = torch.empty(2 * total, dtype=torch.uint8, device=self.device)
        assert dev is not None
        pack(host, tensors, offsets)
        dev[:total].copy_(host[:total], non_blocking=True)
        event = self._copied[i] = self._copied[i] or torch.cuda.Event()
        event.record()
        return [
            dev[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, off in zip(tensors, offsets, strict=True)
        ]
