"""Hands each request's outputs to its callback, per output or all of one step at once.

Without a dispatcher every output goes straight to its sequence's `on_output`. With one (the
service's), a step's (callback, output) pairs are collected and handed over together on `flush`,
so the service wakes its event loop once per step instead of once per sequence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from loraserve.inference_worker.engine.sequence import RequestOutput, Sequence

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]
OutputDispatcher = Callable[[list[tuple[OutputCallback, RequestOutput]]], None]


class OutputQueue:
    def __init__(self) -> None:
        self.dispatcher: OutputDispatcher | None = None
        self._pending: list[tuple[OutputCallback, RequestOutput]] = []

    def emit(self, seq: Sequence, out: RequestOutput) -> None:
        if self.dispatcher is not None:
            self._pending.append((seq.on_output, out))
            return
        try:
            seq.on_output(out)
        except Exception:
            log.debug("dropped output of %s", seq.request_id, exc_info=True)

    def flush(self) -> None:
        if not self._pending or self.dispatcher is None:
            return
        items, self._pending = self._pending, []
        try:
            self.dispatcher(items)
        except Exception:
            log.debug("dropped %d outputs", len(items), exc_info=True)
