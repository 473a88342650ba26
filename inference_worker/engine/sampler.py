"""Next-token choice for a whole batch at once: greedy, or temperature / top-k / top-p sampling.

Sampling is a few batched tensor ops per step however many rows sample, and its randomness is
counter-based: each sampling row draws one uniform number u from a hash of (sequence seed, number
of tokens generated so far) and picks the token where the cumulative distribution crosses u
(inverse-CDF sampling). A seeded request therefore gives the same tokens whatever batch it runs in
and after a preemption and recompute; a row's path depends only on its own parameters:

    x      = logits / temperature                                   # [M, V] rows that sample
    plain rows (no top-k, top-p = 1): token = first v with cumsum(softmax(x))[v] >= u
    other rows: cand = top-K of x (K = largest top_k among them, or a full sort), sorted descending;
                keep = rank < top_k and (mass before it) < top_p;
                token = cand id at the first j with cumsum(p_keep)[j] >= u * sum(p_keep)
"""

from __future__ import annotations

import os

import torch

from inference_worker.engine.sequence import Sequence

_M64 = 0xFFFF_FFFF_FFFF_FFFF


def _mix64(x: int) -> int:
    """splitmix64's finalizer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def uniform(seed: int, step: int) -> float:
    """A uniform number in (0, 1), a pure function of (seed, step)."""
    return ((_mix64(seed ^ _mix64(step)) >> 11) + 0.5) / (1 << 53)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs: [M, K] non-negative (need not sum to 1); u: [M] in (0, 1) -> [M] index of the first
    column whose cumulative mass reaches u x total."""
    cdf = probs.double().cumsum(-1)  # [M, K], float64 so that long vocabularies keep their tail mass
    target = (u.double() * cdf[:, -1]).unsqueeze(-1)  # [M, 1]
    return torch.searchsorted(cdf, target).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


class Sampler:
    def __init__(self) -> None:
        self._seeds: dict[int, int] = {}  # seq_id -> 64-bit seed (drawn once for unseeded requests)

    def seed(self, seq: Sequence) -> int:
        s = self._seeds.get(seq.seq_id)
        if s is None:
            s = seq.params.seed if seq.params.seed is not None else int.from_bytes(os.urandom(8), "little")
            s = self._seeds[seq.seq_id] = s & 0xFFFF_FFFF_FFFF_FFFF
        return s

    def release(self, seq: Sequence) -> None:
        self._seeds.pop(seq.seq_id, None)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: [N, V] float32, one row per sequence -> N token ids."""
        tokens = logits.argmax(dim=-1)  # [N]
        vocab = logits.shape[1]
        plain: list[int] = []
        ordered: list[int] = []
        for i, s in enumerate(seqs):
            p = s.params
            if p.greedy or s.finish_reason is not None:  # finished by a stop string meanwhile
                continue
            (plain if not 0 < p.top_k < vocab and p.top_p >= 1.0 else ordered).append(i)
        for rows, pick in ((plain, self._plain), (ordered, self._ordered)):
            if rows:
                idx = torch.tensor(rows, device=logits.device)
                tokens[idx] = pick(logits[idx], [seqs[i] for i in rows])
        return tokens.tolist()

    def _scaled(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits / temperature [M, V], u [M]) of the rows that sample."""
        dev = logits.device
        # temperatures under 1e-4 behave as greedy up to ties, without overflowing x to inf
        temp = torch.tensor([max(s.params.temperature, 1e-4) for s in seqs], dtype=torch.float32, device=dev)
        u = torch.tensor([uniform(self.seed(s), len(s.output_token_ids)) for s in seqs], dtype=torch.float64,
                         device=dev)
        return logits / temp[:, None], u

    def _plain(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        x, u = self._scaled(logits, seqs)
        return _inverse_cdf(x.softmax(-1), u)

    def _ordered(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        x, u = self._scaled(logits, seqs)
        dev, vocab = x.device, x.shape[1]
        top_k = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in seqs]
        k_max = max(top_k)
        if k_max < vocab:
            cand, ids = torch.topk(x, k_max, dim=-1)  # [M, K] sorted descending
        else:
            cand, ids = torch.sort(x, dim=-1, descending=True)
        rank = torch.arange(cand.shape[1], device=dev)
        cand = cand.masked_fill(rank[None, :] >= torch.tensor(top_k, device=dev)[:, None], float("-inf"))
        probs = cand.softmax(-1)
        top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32, device=dev)
        # drop a candidate once the mass before it reaches top_p (the first always stays)
        probs = probs.masked_fill((probs.cumsum(-1) - probs) >= top_p[:, None], 0.0)
        return ids.gather(-1, _inverse_cdf(probs, u).unsqueeze(-1)).squeeze(-1)
