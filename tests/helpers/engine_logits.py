"""Last-position logits of one prefill step, straight from an engine's model runner (no sampling):
what the LoRA logits tests compare against transformers + peft."""

from __future__ import annotations

import torch

from loraserve.inference_worker.engine.engine import LLMEngine
from loraserve.inference_worker.engine.scheduler import ScheduledBatch
from loraserve.inference_worker.engine.sequence import SamplingParams


def prefill_logits(engine: LLMEngine, rows: list[tuple[str, list[int]]]) -> torch.Tensor:
    """Last-position logits [len(rows), V] of one prefill step over all rows (adapter id, prompt)."""
    seqs = []
    for i, (adapter_id, prompt) in enumerate(rows):
        seq = engine.make_sequence(
            f"p{i}", "", prompt, SamplingParams(max_tokens=1), lambda out: None, adapter_id
        )
        assert engine.policy.can_admit(seq), seq.error
        engine.blocks.allocate(seq, len(prompt))
        seqs.append(seq)
    try:
        logits, order = engine.runner.execute(
            ScheduledBatch(prefills=[(s, s.num_prompt_tokens) for s in seqs])
        )
        assert order == seqs
        return logits
    finally:
        for s in seqs:
            engine.blocks.deallocate(s)
            engine.policy.on_finished(s)
