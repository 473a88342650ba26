"""Rank 0's side of a tensor-parallel worker: its slots remember what changed for the followers,
and its model runner sends each step to them before running it itself.

Only rank 0 schedules, samples, fetches and admits adapters; the followers run the same forward
on their shards. Slot changes travel at the step boundary (step_channel.py): rank 0 may fill a slot
from any thread (the step thread's admission, an admin RPC), but a sequence reads a slot only after
the admission that filled it, so a change is always sent before the first step that reads it. Of
several changes to one slot between two steps only the last is sent.

A collective that raises or times out (a rank died or hangs) fails the whole group: the runner
raises RankFailed, naming the dead rank when there is one, and every later call raises it at once
without entering a collective.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from loraserve.inference_worker.engine.model_runner import ModelRunner
from loraserve.inference_worker.engine.step_plan import StepPlan
from loraserve.inference_worker.errors import RankFailed
from loraserve.inference_worker.lora.payload import AdapterPayload
from loraserve.inference_worker.lora.slots import LoRASlots
from loraserve.inference_worker.parallel.group import TensorParallelGroup
from loraserve.inference_worker.parallel.launcher import FollowerProcesses
from loraserve.inference_worker.parallel.step_channel import Kind, StepChannel


class MirroredSlots(LoRASlots):
    """Rank 0's shard of the slots; every load and clear is also queued for the followers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._changes_lock = threading.Lock()
        self._changes: dict[int, AdapterPayload | None] = {}  # slot -> payload loaded (None: cleared)

    def load(self, slot: int, payload: AdapterPayload) -> None:
        super().load(slot, payload)
        self._record(slot, payload)

    def clear(self, slot: int) -> None:
        super().clear(slot)
        self._record(slot, None)

    def _record(self, slot: int, payload: AdapterPayload | None) -> None:
        with self._changes_lock:
            self._changes.pop(slot, None)  # re-inserted last: changes keep their order
            self._changes[slot] = payload

    def take_changes(self) -> list[tuple[int, AdapterPayload | None]]:
        with self._changes_lock:
            changes, self._changes = list(self._changes.items()), {}
        return changes


class LeaderRunner(ModelRunner):
    """The model runner of rank 0: each collective-bearing call is announced to the followers
    first, so every rank enters the same collectives in the same order."""

    sharded = True

    def __init__(
        self,
        tp: TensorParallelGroup,
        followers: FollowerProcesses,
        slots: MirroredSlots | None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.tp, self.followers, self.slots = tp, followers, slots
        self.channel = StepChannel(tp.cpu_group, tp.step_timeout)
        self._closed = False

    @contextmanager
    def _group(self) -> Iterator[None]:
        """Collectives with the followers; any failure of them is the group's RankFailed."""
        if (failure := self.followers.failure) is not None:
            raise failure
        try:
            yield
        except RankFailed:
            raise
        except Exception as exc:
            raise self.followers.failure_after(exc) from exc

    def run(self, plan: StepPlan, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        if plan.pending:  # the other ranks get the inputs from the plan alone
            raise ValueError("a tensor-parallel step cannot read tokens still on the device")
        with self._group():
            self._send_slot_changes()
            self.channel.send_step(plan)
            return super().run(plan)

    def _send_slot_changes(self) -> None:
        if self.slots is None:
            return
        for slot, payload in self.slots.take_changes():
            if payload is None:
                self.channel.send_clear(slot)
            else:
                self.channel.send_load(slot, payload)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        with self._group():
            self.channel.send_copy(src, dst)
            super().copy_blocks(src, dst)

    def capture_graphs(self) -> None:
        if self._want_graphs and not self.graphs:
            with self._group():
                self._send_slot_changes()  # adapters pinned before start are in the captured slots
                self.channel.send(Kind.CAPTURE)
                super().capture_graphs()

    def close(self) -> None:
        """Tell the followers to exit, wait for them, leave the group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.followers.failure is None:
            self.followers.expect_exit()
            try:
                self.channel.send(Kind.STOP)
            except Exception:  # a follower is already gone: the others see the broken group and exit
                pass
        self.followers.join()
        self.tp.close()
