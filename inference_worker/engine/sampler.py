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

Penalties change the logits before any of that (greedy rows too), as vLLM orders them; c[v] counts
token v among the generated tokens, seen[v] says v is in the prompt or among them:

    x[v] -= frequency_penalty * c[v] + presence_penalty * (c[v] > 0)          # OpenAI
    x[v]  = x[v] / r if x[v] > 0 else x[v] * r,  for seen[v], r = repetition_penalty  # Hugging Face

Log-probabilities are those of the model itself, log_softmax of its logits before penalties,
temperature, top-k and top-p (vLLM's default): a token's logprob does not depend on how it was
picked. The top alternatives come from one `topk` over the rows that ask for them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from loraserve.inference_worker.engine.penalties import TokenCounts
from loraserve.inference_worker.engine.sequence import Sequence, TokenLogprob
from loraserve.inference_worker.engine.transfer import to_device

MAX_TOP_LOGPROBS = 20

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


def greedy(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[n] = argmax of row n of x (ties: the lowest column): on CUDA with float32 rows
    model/row_argmax.py's kernel, which spreads a row over the GPU; else torch.argmax."""
    if x.is_cuda and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1:
        from loraserve.inference_worker.model.row_argmax import row_argmax

        return row_argmax(x, out=out)
    return torch.argmax(x, dim=-1, out=out)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs: [M, K] non-negative (need not sum to 1); u: [M] in (0, 1) -> [M] index of the first
    column whose cumulative mass reaches u x total."""
    cdf = probs.double().cumsum(-1)  # [M, K], float64 so that long vocabularies keep their tail mass
    target = (u.double() * cdf[:, -1]).unsqueeze(-1)  # [M, 1]
    return torch.searchsorted(cdf, target).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # per row; None where not asked for


class TokenReadback:
    """Pinned host buffers that steps' sampled tokens are copied into, in turn: no pinned
    allocation a step. A buffer is reused DEPTH launches later; the engine reads each step back
    within two, and a read of a buffer already reused raises instead of returning other tokens."""

    DEPTH = 4

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * self.DEPTH
        self._turn = 0  # launches so far

    def copy(self, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Queue the copy of `tokens` (int64 on the device) to the host; -> (its host view, turn)."""
        i, n = self._turn % self.DEPTH, tokens.numel()
        buf = self._buffers[i]
        if buf is None or buf.numel() < n:
            buf = self._buffers[i] = torch.empty(max(n, 256), dtype=tokens.dtype, pin_memory=True)
        self._turn += 1
        return buf[:n].copy_(tokens, non_blocking=True), self._turn - 1

    def check(self, turn: int) -> None:
        if self._turn - turn > self.DEPTH:
            raise RuntimeError("sampled tokens read back after their buffer was reused")


@dataclass
class LaunchedSample:
    """One step's sampling, queued on the device and not yet read back (`Sampler.finish`)."""

    tokens: torch.Tensor  # [N] int64 on the device, one per row
    seqs: list[Sequence]  # row i belongs to seqs[i]
    logprob_rows: list[int]  # rows that asked for logprobs
    top_ks: list[int]  # their top_logprobs
    chosen: torch.Tensor | None = None  # [M] logprob of each such row's token
    top_values: torch.Tensor | None = None  # [M, K]
    top_ids: torch.Tensor | None = None  # [M, K]
    # on CUDA: the tensors above copied into pinned host memory right after this step's sampling,
    # and an event after those copies; `finish` waits for that event, not for later steps
    host: list[torch.Tensor | None] | None = None
    copied: torch.cuda.Event | None = None
    ring: TokenReadback | None = None  # where the tokens' host copy lives, and its turn there
    ring_turn: int = 0
    started: torch.cuda.Event | None = None  # a timed step's event before its first launch
    waited: float = 0.0  # seconds `read` waited for the device

    def start_readback(self, ring: TokenReadback) -> None:
        """Queue the copies to the host (CUDA), so that reading them waits for this step only: the
        tokens into `ring`'s pinned buffers, the logprob tensors (rarely asked for) into new ones."""
        if not self.tokens.is_cuda:
            return
        tokens, self.ring_turn = ring.copy(self.tokens)
        self.ring = ring
        self.host = [tokens]
        self.host += [
            None
            if t is None
            else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for t in (self.chosen, self.top_values, self.top_ids)
        ]
        self.copied = torch.cuda.Event(enable_timing=self.started is not None)
        self.copied.record()

    def read(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(tokens, chosen, top_values, top_ids) on the host, once the device has produced them."""
        if self.host is None:
            return self.tokens, self.chosen, self.top_values, self.top_ids
        assert self.copied is not None
        if not self.copied.query():  # (done already: no wait, and the interpreter is kept)
            t0 = time.perf_counter()
            self.copied.synchronize()
            self.waited = time.perf_counter() - t0
        if self.ring is not None:
            self.ring.check(self.ring_turn)
        tokens, chosen, top_values, top_ids = self.host
        assert tokens is not None
        return tokens, chosen, top_values, top_ids


class Sampler:
    def __init__(self) -> None:
        self._seeds: dict[int, int] = {}  # seq_id -> 64-bit seed (drawn once for unseeded requests)
        self._counts: TokenCounts | None = None  # token counts of the penalized sequences
        self._readback = TokenReadback()

    def seed(self, seq: Sequence) -> int:
        s = self._seeds.get(seq.seq_id)
        if s is None:
            s = seq.params.seed if seq.params.seed is not None else int.from_bytes(os.urandom(8), "little")
            s = self._seeds[seq.seq_id] = s & 0xFFFF_FFFF_FFFF_FFFF
        return s

    def release(self, seq: Sequence) -> None:
        self._seeds.pop(seq.seq_id, None)
        if self._counts is not None:
            self._counts.release(seq)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: [N, V] float32, one row per sequence -> N token ids."""
        return self.step(logits, seqs).token_ids

    def step(self, logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
        """logits: [N, V] float32, one row per sequence -> N tokens (and logprobs where asked)."""
        return self.finish(self.launch(logits, seqs))

    def launch(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        started: torch.cuda.Event | None = None,
        buffer: torch.Tensor | None = None,
        argmax_ready: bool = False,
    ) -> LaunchedSample:
        """Queue the sampling of one step on the device without waiting for it: its tokens can feed
        the next step on the device before the host reads them (`finish`). Each row's random draw
        is taken at its sequence's next output position, counting a token still on the device.
        `started`: an event recorded before the step's first launch, to time the step from.
        `buffer`: [N] int64 on the device to hold the tokens (else a new tensor); `argmax_ready`: it
        holds the argmax of `logits` already (ModelRunner.token_buffer)."""
        live = [i for i, s in enumerate(seqs) if s.finish_reason is None]  # not ended by a stop string
        penalized = [i for i in live if seqs[i].params.penalized]
        x = self.apply_penalties(logits, seqs, penalized)
        if buffer is None:
            tokens = greedy(x, torch.empty(x.shape[0], dtype=torch.int64, device=x.device))  # [N]
        else:
            tokens = buffer
            if not (argmax_ready and x is logits):  # (penalties change the greedy choices)
                greedy(x, tokens)
        vocab = logits.shape[1]
        plain: list[int] = []
        ordered: list[int] = []
        for i in live:
            p = seqs[i].params
            if not p.greedy:
                (plain if not 0 < p.top_k < vocab and p.top_p >= 1.0 else ordered).append(i)
        for rows, pick in ((plain, self._plain), (ordered, self._ordered)):
            if rows:
                idx = to_device(rows, logits.device)
                tokens[idx] = pick(x[idx], [seqs[i] for i in rows])
        if penalized:
            assert self._counts is not None
            self._counts.add([seqs[i] for i in penalized], tokens[to_device(penalized, x.device)])
        wanted = [i for i in live if seqs[i].params.logprobs]
        out = LaunchedSample(tokens, seqs, wanted, [], started=started)
        if wanted:
            self._launch_logprobs(out, logits, [seqs[i] for i in wanted])
        out.start_readback(self._readback)
        return out

    @staticmethod
    def finish(launched: LaunchedSample) -> Sampled:
        """Read a launched step's tokens (and logprobs) back to the host: waits for the device."""
        logprobs: list[TokenLogprob | None] = [None] * len(launched.seqs)
        tokens, chosen_t, top_values, top_ids = launched.read()
        token_ids: list[int] = tokens.tolist()
        rows = launched.logprob_rows
        if rows:
            assert chosen_t is not None
            chosen: list[float] = chosen_t.tolist()
            top_v: list[list[float]] = [[] for _ in rows]
            top_i: list[list[int]] = [[] for _ in rows]
            if top_values is not None and top_ids is not None:
                top_v, top_i = top_values.tolist(), top_ids.tolist()
            for row, c, ti, tv, k in zip(rows, chosen, top_i, top_v, launched.top_ks, strict=True):
                logprobs[row] = TokenLogprob(token_ids[row], c, tuple(zip(ti[:k], tv[:k], strict=True)))
        return Sampled(token_ids, logprobs)

    def apply_penalties(
        self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int] | None = None
    ) -> torch.Tensor:
        """logits [N, V] with the penalties of seqs[i] applied to row i for i in `rows` (default:
        every row with a penalty); a copy, or `logits` itself when no row has one."""
        if rows is None:
            rows = [i for i, s in enumerate(seqs) if s.params.penalized]
        if not rows:
            return logits
        if self._counts is None:
            self._counts = TokenCounts(logits.shape[1], logits.device)
        dev = logits.device
        idx = to_device(rows, dev)
        seqs = [seqs[i] for i in rows]
        counts, seen = self._counts.get(seqs)  # [M, V] int32, [M, V] bool
        x = logits[idx]
        pres = to_device([s.params.presence_penalty for s in seqs], dev, x.dtype)[:, None]
        freq = to_device([s.params.frequency_penalty for s in seqs], dev, x.dtype)[:, None]
        rep = to_device([s.params.repetition_penalty for s in seqs], dev, x.dtype)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - pres * (counts > 0)
        out = logits.clone()
        out[idx] = x
        return out

    @staticmethod
    def _launch_logprobs(out: LaunchedSample, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        idx = to_device(out.logprob_rows, logits.device)
        lp = logits[idx].float().log_softmax(-1)  # [M, V]
        out.chosen = lp.gather(-1, out.tokens[idx].unsqueeze(-1)).squeeze(-1)
        out.top_ks = [min(s.params.top_logprobs, lp.shape[1]) for s in seqs]
        if max(out.top_ks) > 0:
            out.top_values, out.top_ids = lp.topk(max(out.top_ks), dim=-1)  # [M, K] most likely first

    def _scaled(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits / temperature [M, V], u [M]) of the rows that sample."""
        dev = logits.device
        # temperatures under 1e-4 behave as greedy up to ties, without overflowing x to inf
        temp = to_device([max(s.params.temperature, 1e-4) for s in seqs], dev, torch.float32)
        u = to_device([uniform(self.seed(s), s.num_generated) for s in seqs], dev, torch.float64)
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
        cand = cand.masked_fill(rank[None, :] >= to_device(top_k, dev)[:, None], float("-inf"))
        probs = cand.softmax(-1)
        top_p = to_device([s.params.top_p for s in seqs], dev, torch.float32)
        # drop a candidate once the mass before it reaches top_p (the first always stays)
        probs = probs.masked_fill((probs.cumsum(-1) - probs) >= top_p[:, None], 0.0)
        return ids.gather(-1, _inverse_cdf(probs, u).unsqueeze(-1)).squeeze(-1)
