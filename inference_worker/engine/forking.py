"""The n > 1 siblings of a request start from its first sequence's prompt KV.

Once the first sequence's prompt is computed, each sibling shares its full KV blocks (a copy of
the partial last one each) and samples its first token from the first sequence's logits row. A
sibling that gets no block, or not the same adapter version, is queued to compute its prompt itself.
"""

from __future__ import annotations

import torch

from loraserve.inference_worker.engine.adapter_hooks import AdmissionPolicy
from loraserve.inference_worker.engine.block_manager import BlockManager
from loraserve.inference_worker.engine.model_runner import ModelRunner
from loraserve.inference_worker.engine.scheduler import Scheduler
from loraserve.inference_worker.engine.sequence import Sequence, SequenceStatus
from loraserve.inference_worker.engine.transfer import to_device


class SiblingForker:
    def __init__(
        self, blocks: BlockManager, scheduler: Scheduler, policy: AdmissionPolicy, runner: ModelRunner
    ) -> None:
        self.blocks, self.scheduler, self.policy, self.runner = blocks, scheduler, policy, runner

    def fork(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """logits [S, V] of `seqs` -> logits and sequences with a row added per forked sibling."""
        parents = [i for i, s in enumerate(seqs) if s.forks and s.finish_reason is None]
        if not parents:
            return logits, seqs
        rows = list(range(len(seqs)))
        seqs = list(seqs)
        copies: list[tuple[int, int]] = []  # (source block, destination block)
        for i in parents:
            parent = seqs[i]
            for child in parent.forks:
                child.admitted_time = parent.admitted_time
                if self.blocks.can_fork(parent) and self._admit(parent, child):
                    copy = self.blocks.fork(parent, child)
                    if copy is not None:
                        copies.append(copy)
                    self.scheduler.add_forked(child)
                else:  # no block (or adapter) for it now: it computes its prompt itself later
                    child.status = SequenceStatus.WAITING
                    self.scheduler.waiting.appendleft(child)
                rows.append(i)
                seqs.append(child)
            parent.forks = []
        if copies:
            self.runner.copy_blocks([c[0] for c in copies], [c[1] for c in copies])
        return logits[to_device(rows, logits.device)], seqs

    def _admit(self, parent: Sequence, child: Sequence) -> bool:
        """Hold the adapter for `child`; False (holding nothing) unless it gets the parent's slot."""
        if not self.policy.can_admit(child):
            return False
        if (child.lora_slot, child.adapter_digest) != (parent.lora_slot, parent.adapter_digest):
            self.policy.on_finished(child)  # another adapter version now: the shared KV is not its own
            return False
        return True
