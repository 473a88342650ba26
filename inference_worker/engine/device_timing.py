"""Where a step's time goes between the host and the device, measured while the engine serves.

Two figures, both cheap enough to keep on:
- the time the step thread waits for the device to hand back a step's tokens. Near zero, the host
  is the bottleneck (the device finishes each step before the host asks); large, the device is.
- the device time of one step in `EVERY`: an event recorded before the step's first launch and
  the one recorded after its tokens' copy to the host. While the host is the bottleneck this
  includes the gaps in which the device waited for the host to launch more work."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loraserve.inference_worker.engine.sampler import LaunchedSample


class DeviceTiming:
    EVERY = 16

    def __init__(self, on_cuda: bool) -> None:
        self.enabled = on_cuda
        self._steps = 0
        # called as each step is read back: observer(seconds waited, device seconds or None)
        self.observer: Callable[[float, float | None], None] | None = None

    def begin(self) -> torch.cuda.Event | None:
        """Before a step's first launch: an event to time it from, for one step in EVERY."""
        if not self.enabled:
            return None
        self._steps += 1
        if self._steps % self.EVERY:
            return None
        started = torch.cuda.Event(enable_timing=True)
        started.record()
        return started

    def observe(self, launched: LaunchedSample) -> None:
        """After a step was read back (its end event has completed)."""
        span = None
        if launched.started is not None and launched.copied is not None:
            span = launched.started.elapsed_time(launched.copied) / 1e3
        if self.observer is not None:
            self.observer(launched.waited, span)
