"""Continuous batching: which sequences run in the next step, and with how many tokens.

Each step has a token budget (`max_num_batched_tokens`). Running sequences go first, in admission
order: a decoding sequence takes 1 token, a prefilling one a chunk of what is left of its prompt,
so a long prompt is spread over several steps while the others keep decoding. Then waiting
sequences are admitted while the running set is below `max_num_seqs`, budget remains and their
first chunk's KV blocks fit. The admission policy may decline a sequence (its adapter is not
resident yet); the scan goes on past it, so one cold adapter blocks nobody. After admission the
policy sees the rest of the queue (`look_ahead`) to bring adapters in before their turn. When a running sequence
needs a block and none is free, the most recently admitted running sequence is preempted: its
blocks are freed and it goes back to the head of the queue to be recomputed later. The n
completions of one request are admitted together (the siblings fork from the first sequence's
prompt KV when its prefill is done), so the group counts n against `max_num_seqs` from admission
until its siblings have forked.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, get_args

from loraserve.inference_worker.engine.adapter_hooks import AdmissionPolicy
from loraserve.inference_worker.engine.block_manager import BlockManager
from loraserve.inference_worker.engine.sequence import Sequence, SequenceStatus

# queue_empty: every waiting sequence was admitted (or none waited); the others name what held one
# back: the running set's size, the step's token budget, KV memory, an adapter not resident yet
# (the scan went past it), a preempted sequence whose last token is still on the device, or a
# preemption in this pass (which admits nothing)
AdmissionOutcome = Literal[
    "queue_empty", "max_num_seqs", "token_budget", "kv_memory", "adapter_wait", "pending_token", "preempted"
]
ADMISSION_OUTCOMES: tuple[AdmissionOutcome, ...] = get_args(AdmissionOutcome)


@dataclass
class ScheduledBatch:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    decodes: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # admission failed for good (seq.error)
    # what ended the admission pass (one of ADMISSION_OUTCOMES): why a step with requests waiting
    # carried fewer than max_num_seqs sequences, when it did
    admission: AdmissionOutcome = "queue_empty"

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(
        self, blocks: BlockManager, policy: AdmissionPolicy, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.blocks, self.policy = blocks, policy
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._preempted = False
        # running sequences whose siblings have not forked yet: places in the running set held
        # for them (a few at a time; pruned as they fork, end or are preempted)
        self._forking: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks at once."""
        if self._forking:
            self._forking = [s for s in self._forking if s is not seq]
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            seq.status = SequenceStatus.FINISHED
            self.blocks.deallocate(seq)
            self.policy.on_finished(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED
            self.blocks.deallocate(seq)
        else:  # PENDING: a sibling never scheduled, holding nothing
            seq.status = SequenceStatus.FINISHED

    def add_forked(self, seq: Sequence) -> None:
        """A sibling that shares its parent's prompt KV joins the running set (already admitted)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.policy.on_finished(seq)
        self.waiting.appendleft(seq)

    def _reserve(self, seq: Sequence, num_tokens: int, scheduled: set[int]) -> bool:
        """Make room for `seq` to hold `num_tokens`, preempting from the back; False if `seq` itself went."""
        if len(seq.block_table) * self.blocks.block_size >= num_tokens:
            return True  # the common decode step: room left in the last block
        while not self.blocks.can_allocate(seq, num_tokens):
            victims = [s for s in reversed(self.running) if s.seq_id not in scheduled]
            victim = victims[0] if victims else seq
            self._preempt(victim)
            self._preempted = True
            if victim is seq:
                return False
        self.blocks.allocate(seq, num_tokens)
        return True

    def schedule(self) -> ScheduledBatch:
        out = self._admit()
        # what still waits, in arrival order: its adapters may be brought in before its turn
        self.policy.look_ahead(self.waiting)
        return out

    def _admit(self) -> ScheduledBatch:
        out = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        self._preempted = False
        # decoding sequences first (1 token each), then chunks of the prefilling ones; a sequence's
        # tokens left to compute change only when it is preempted (then it no longer runs)
        left = [(s, s.num_tokens - s.num_computed_tokens) for s in self.running]
        ordered = [p for p in left if p[1] == 1]
        if len(ordered) < len(left):
            ordered += [p for p in left if p[1] > 1]
        for seq, todo in ordered:
            if seq.status is not SequenceStatus.RUNNING or budget <= 0 or seq.ends_with_pending:
                continue  # (a token still on the device is its last: nothing to run)
            n = min(todo, budget)
            scheduled.add(seq.seq_id)
            if not self._reserve(seq, seq.num_computed_tokens + n, scheduled):
                continue
            budget -= n
            self._place(out, seq, n, todo)
        if self._preempted:
            out.admission = "preempted"
            return out
        held = self._held_for_siblings() if self.waiting else 0
        declined = pending = False
        for seq in list(self.waiting):
            # an n > 1 request is admitted with room for its siblings, which fork from it
            if len(self.running) + held + 1 + len(seq.forks) > self.max_num_seqs:
                out.admission = "max_num_seqs"
                break
            if budget <= 0:
                out.admission = "token_budget"
                break
            if seq.num_pending:  # its last token is still on the device: its prompt waits for it
                pending = True
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            needed = self.blocks.num_new_blocks(seq, seq.num_computed_tokens + n)
            free = self.blocks.num_free_blocks
            # memory is first come, first served; room for the siblings' partial blocks is waited
            # for only while others run (when they cannot fork they compute their prompt later)
            if needed > free or (self.running and needed + len(seq.forks) > free):
                out.admission = "kv_memory"
                break
            if not self.policy.can_admit(seq):
                if seq.error is not None:
                    out.failed.append(seq)
                else:
                    declined = True
                continue
            self.waiting.remove(seq)
            self.blocks.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            if seq.admitted_time is None:
                seq.admitted_time = time.monotonic()
            self.running.append(seq)
            if seq.forks:
                self._forking.append(seq)
                held += len(seq.forks)
            budget -= n
            self._place(out, seq, n, seq.num_uncomputed_tokens)
        else:
            if declined:
                out.admission = "adapter_wait"
            elif pending:
                out.admission = "pending_token"
        return out

    def _held_for_siblings(self) -> int:
        """Places the running sequences hold for siblings that have not forked from them yet."""
        if self._forking:
            self._forking = [s for s in self._forking if s.forks and s.status is SequenceStatus.RUNNING]
        return sum(len(s.forks) for s in self._forking)

    @staticmethod
    def _place(out: ScheduledBatch, seq: Sequence, n: int, todo: int) -> None:
        """`n` of the `todo` tokens `seq` has left to compute run this step."""
        if todo == 1:
            out.decodes.append(seq)
        else:
            out.prefills.append((seq, n))
