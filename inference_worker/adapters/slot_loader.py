"""GPU slot loads off the step thread: a CPU-tier payload is copied into its slot by a thread of
its own, on a CUDA stream of its own, while the engine goes on stepping.

On the step thread a load would cost a couple of torch calls, and each is a point where the
thread gives the interpreter lock up and must wait to get it back while the event loop (token
streams, fetch hand-overs) holds it. Here the step thread only marks the slot as loading
(`SlotState.loading`) and admits other requests; the sequences that wait for the adapter are
admitted at the first step after the copy has completed on the device (`on_done` wakes the
engine).

Ordering on the device: the victim slot's old adapter may still be read by steps in flight, so
the loader's stream waits for an event recorded on the steps' stream at the start of each load;
the copy's own completion is waited for on the loader's thread before the slot admits anything.
Loads run one at a time and hold the slots' staging lock until their copies completed, so a
synchronous load (the admin path) never shares the staging buffer with one in flight. Where
there is no CUDA the copy runs on the loader's thread all the same (the tests' path)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraserve.inference_worker.adapters.slot_table import SlotState
from loraserve.inference_worker.lora.payload import AdapterPayload
from loraserve.inference_worker.lora.slots import LoRASlots

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotLoad:
    slot: SlotState
    ticket: int  # the slot's `loading` value while this load is its current one
    payload: AdapterPayload


# called on the loader's thread when a load ends: (the load, seconds it took, its error or None)
Finished = Callable[[SlotLoad, float, Exception | None], None]


class SlotLoader:
    def __init__(self, slots: LoRASlots, finished: Finished) -> None:
        self.slots, self._finished = slots, finished
        self.on_done: list[Callable[[], None]] = []  # woken after each load (the engine)
        cuda = slots.device.type == "cuda"
        # the stream the engine's steps run on (the default one: the step thread never sets one)
        self._steps = torch.cuda.current_stream(slots.device) if cuda else None
        self._stream = torch.cuda.Stream(slots.device) if cuda else None
        self._queue: queue.SimpleQueue[SlotLoad | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._tickets = 0
        self.num_loads = 0

    def submit(self, s: SlotState, payload: AdapterPayload) -> None:
        """Mark `s` loading and queue the copy (under the adapters' state lock)."""
        self._tickets += 1
        s.loading = self._tickets
        self._queue.put(SlotLoad(s, self._tickets, payload))
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="adapter-slot-loader", daemon=True)
                    self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while (load := self._queue.get()) is not None:
            t0 = time.perf_counter()
            error: Exception | None = None
            try:
                self._copy(load.slot.index, load.payload)
            except Exception as exc:  # reported to the sequences that wait for it
                error = exc
            try:
                self._finished(load, time.perf_counter() - t0, error)
            except Exception:
                log.exception("recording the slot load of %s failed", load.payload.key)
            self.num_loads += 1
            for wake in self.on_done:
                wake()

    def _copy(self, index: int, payload: AdapterPayload) -> None:
        if self._stream is None or self._steps is None:
            self.slots.load(index, payload)
            return
        with self.slots.staging_lock, torch.cuda.device(self.slots.device):
            after = torch.cuda.Event()
            after.record(self._steps)  # every step launched so far, which may read the old adapter
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(after)
                self.slots.load(index, payload)
                done = torch.cuda.Event()
                done.record(self._stream)
            done.synchronize()
