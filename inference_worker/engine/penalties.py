"""Per-sequence token counts on the device, for the penalties of the sampler.

A sequence that uses a penalty gets a row in two [R, V] tables when it first samples: `counts`
(how often each token was generated) and `prompt` (which tokens its prompt holds). Each step adds
the sampled tokens with one scatter, so the cost per step does not grow with the output length;
rows are recycled when sequences finish and the tables double when full. A preempted sequence
keeps its row (its tokens do not change when it is recomputed).
"""

from __future__ import annotations

import torch

from loraserve.inference_worker.engine.sequence import Sequence
from loraserve.inference_worker.engine.transfer import to_device


class TokenCounts:
    def __init__(self, vocab_size: int, device: torch.device, rows: int = 8) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros((rows, vocab_size), dtype=torch.int32, device=device)
        self.prompt = torch.zeros((rows, vocab_size), dtype=torch.bool, device=device)
        self._rows: dict[int, int] = {}  # seq_id -> row
        self._free = list(range(rows - 1, -1, -1))

    def _grow(self) -> None:
        n = self.counts.shape[0]
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.prompt = torch.cat([self.prompt, torch.zeros_like(self.prompt)])
        self._free.extend(range(2 * n - 1, n - 1, -1))

    def _row(self, seq: Sequence) -> int:
        r = self._rows.get(seq.seq_id)
        if r is None:
            if not self._free:
                self._grow()
            r = self._rows[seq.seq_id] = self._free.pop()
            self.counts[r].zero_()
            self.prompt[r].zero_()
            self.prompt[r, to_device(seq.prompt_token_ids, self.device)] = True
            if seq.output_token_ids:
                out = to_device(seq.output_token_ids, self.device)
                self.counts[r].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        return r

    def get(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (counts [M, V] int32 of the generated tokens, seen [M, V] bool: in prompt or output)."""
        idx = to_device([self._row(s) for s in seqs], self.device)
        counts = self.counts[idx]
        return counts, self.prompt[idx] | (counts > 0)

    def add(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        """Count one sampled token per sequence. tokens: [M] int64."""
        idx = to_device([self._rows[s.seq_id] for s in seqs], self.device)
        self.counts.index_put_((idx, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def release(self, seq: Sequence) -> None:
        r = self._rows.pop(seq.seq_id, None)
        if r is not None:
            self._free.append(r)
