"""Reused host buffers for adapter payloads: pinned on CUDA hosts, ordinary memory otherwise.

Under adapter churn every fetch needs tens of MB of pinned memory, and pinning is slow
(cudaHostAlloc maps and locks every page). A payload's buffer is taken from this pool and comes
back when the payload is gone (garbage-collected: out of the CPU tier, and no slot load, step
message or fetch holds it any more), and the next payload of its size class reuses it.

    size class   the size rounded up to a power of two below 1 MiB, to a multiple of 1 MiB above
    free[class]  [(buffer, CUDA events of reads still in flight)], most recently returned last
    take(n)      a free buffer of n's class whose reads are all done (hit), else a new one (miss);
                 the first n bytes, as [n] uint8
    adopt(p)     p.data goes back to the pool once p is collected, with p.reads (the events
                 recorded after each non-blocking host-to-device copy from it)

A returned buffer is kept only while the free buffers' total stays within `max_idle_bytes`; past
that it is left to be freed. Thread-safe: fetch threads take, any thread may drop the last
reference to a payload (even from inside `take`, through the garbage collector).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

MIB = 1 << 20


def size_class(nbytes: int) -> int:
    """Bytes of the buffer that holds `nbytes`: a power of two below 1 MiB, else a multiple of 1 MiB."""
    if nbytes <= 0:
        return 0
    if nbytes < MIB:
        return 1 << (nbytes - 1).bit_length()
    return -(-nbytes // MIB) * MIB


def reads_done(reads: list[Any]) -> bool:
    """Every recorded read (a torch.cuda.Event) completed."""
    return all(e.query() for e in reads)


class HostBufferPool:
    def __init__(
        self,
        max_idle_bytes: int = 1 << 30,
        *,
        pin: bool | None = None,
        count: Callable[[str], None] | None = None,
    ) -> None:
        """count: called with "hit" or "miss" at every take (the worker's metrics)."""
        if max_idle_bytes < 0:
            raise ValueError("max_idle_bytes must be >= 0")
        self.max_idle_bytes = max_idle_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._count = count
        self._lock = threading.RLock()  # a finalizer may run inside take, on the same thread
        self._free: dict[int, list[tuple[torch.Tensor, list[Any]]]] = {}
        self.idle_bytes = 0
        self.num_hits = self.num_misses = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """[nbytes] uint8 host memory (pinned when the pool pins), contents undefined."""
        cls = size_class(nbytes)
        buf = None
        with self._lock:
            free = self._free.get(cls, [])
            for i in range(len(free) - 1, -1, -1):
                if reads_done(free[i][1]):
                    buf = free.pop(i)[0]
                    self.idle_bytes -= cls
                    break
            if buf is not None:
                self.num_hits += 1
            else:
                self.num_misses += 1
        if self._count is not None:
            self._count("hit" if buf is not None else "miss")
        if buf is None:
            buf = torch.empty(cls, dtype=torch.uint8, pin_memory=self.pin)
        return buf[:nbytes]

    def adopt(self, owner: Any, data: torch.Tensor, reads: list[Any]) -> None:
        """Take `data` (from `take`) back once `owner` is collected; `reads` may grow until then."""
        weakref.finalize(owner, self.give_back, data, reads)

    def give_back(self, data: torch.Tensor, reads: list[Any] | None = None) -> None:
        """Return a buffer from `take`; reused once every event in `reads` completed."""
        base = data if data._base is None else data._base
        cls = base.numel()
        if cls != size_class(cls) or base.is_pinned() != self.pin:
            return  # not one of ours
        pending = [e for e in (reads or []) if not e.query()]
        with self._lock:
            if self.idle_bytes + cls > self.max_idle_bytes:
                return
            self._free.setdefault(cls, []).append((base, pending))
            self.idle_bytes += cls

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.idle_bytes = 0
