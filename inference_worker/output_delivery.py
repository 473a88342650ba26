"""How the engine's outputs reach the generations' calls on the event loop.

The step thread hands each step's (callback, output) pairs over (`Handover.dispatch`); the event
loop takes everything handed over since it last looked in one pass (`Handover.drain`). While the
loop keeps up that is one step's outputs; when it falls behind, a sequence's consecutive outputs
are merged first (same completion, tokens, text and logprobs in order; never past an error or an
ending), so a loop that is behind sends fewer, larger messages instead of falling further behind.
A relayed stream's running outputs go straight to the front from there (`split`); its last one
goes through the call's task, which ends the call.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from loraserve.inference_worker.engine.output_queue import OutputCallback
from loraserve.inference_worker.engine.sequence import RequestOutput
from loraserve.inference_worker.output_reader import mergeable, merged_run

log = logging.getLogger("loraserve.worker")
Items = list[tuple[OutputCallback, RequestOutput]]


def deliver(items: Items) -> None:
    for callback, out in items:
        try:
            callback(out)
        except Exception:  # one call's failure never keeps the others' outputs back
            log.exception("delivering an output of request %s failed", out.request_id)


def coalesce(items: Items) -> Items:
    """Each callback's consecutive outputs of one completion merged, in order; callbacks in the
    order they first appear."""
    by_callback: dict[OutputCallback, list[list[RequestOutput]]] = {}
    for callback, out in items:
        runs = by_callback.get(callback)
        if runs is None:
            by_callback[callback] = [[out]]
        elif mergeable(runs[-1][-1], out):
            runs[-1].append(out)
        else:
            runs.append([out])
    return [(callback, merged_run(run)) for callback, runs in by_callback.items() for run in runs]


class Handover:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: Items = []
        self._steps = 0  # steps handed over since the loop last drained

    def dispatch(self, items: Items) -> None:
        """The step thread: one step's outputs; wakes the loop unless a drain is already due."""
        with self._lock:
            self._items += items
            self._steps += 1
            if self._steps > 1:
                return
        self.loop.call_soon_threadsafe(self.drain)

    def drain(self) -> None:
        """The event loop: everything handed over so far."""
        with self._lock:
            items, steps = self._items, self._steps
            self._items, self._steps = [], 0
        deliver(coalesce(items) if steps > 1 else items)


def split(
    direct: Callable[[RequestOutput], None], queued: Callable[[RequestOutput], None]
) -> Callable[[RequestOutput], None]:
    """A generation's output callback that sends its running outputs with `direct` as they come
    and queues the last one (or an error) for the call's task, which ends the call. A `direct`
    that fails queues the failure instead: the call ends with it."""

    def on_output(out: RequestOutput) -> None:
        if out.last:
            queued(out)
            return
        try:
            direct(out)
        except Exception as exc:
            log.exception("sending an output of request %s failed", out.request_id)
            queued(
                RequestOutput(out.request_id, [], "", error=RuntimeError(f"sending the output failed: {exc}"))
            )

    return on_output


def dispatch_on(loop: asyncio.AbstractEventLoop) -> Callable[[Items], None]:
    """An engine output dispatcher that hands outputs over to `loop`."""
    return Handover(loop).dispatch
