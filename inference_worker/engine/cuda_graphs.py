"""The model runner's CUDA graphs: one model call each, captured once, replayed on static buffers.

- Decode-only steps, by batch size: logits of every row. Padding rows hold token 0 at position 0
  and write the reserved KV block 0.
- Steps with prefill chunks, by token count: every row is a prefill segment (a decode is a
  segment of one token; model_runner.py), and the graph returns the hidden states of the rows the
  step samples from; the runner computes their logits outside the graph, which keeps each graph's
  own output small. Padding tokens belong to no segment and padding segments hold no token.

With adapters, each graph has a base-only twin without the LoRA path. All graphs share one memory
pool: one replays at a time.

The step's sampled tokens live in one static buffer (`tokens`): a decode graph writes the greedy
choice of each row there itself (sampler.greedy: model/row_argmax.py on CUDA), and the sampler
writes every step's tokens there (`Sampler.launch`).
Each graph begins by taking its rows' input ids from that buffer where the step's `source` column
says so (a decode row whose token the previous step sampled and the host has not read yet), so that
no launch outside the graph moves them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from loraserve.inference_worker.engine.sampler import greedy
from loraserve.inference_worker.engine.step_plan import LoRABatchSource
from loraserve.inference_worker.model.forward_batch import ForwardBatch
from loraserve.inference_worker.model.llama import LlamaModel
from loraserve.kernels import LoRABatch
from loraserve.serving.gc_tuning import no_collections

log = logging.getLogger(__name__)


def mixed_segments(tokens: int, max_num_seqs: int) -> int:
    """Segments of the graph for steps with prefill chunks padded to `tokens` tokens."""
    return min(tokens, max_num_seqs)


class StepGraphs:
    def __init__(
        self,
        model: LlamaModel,
        adapters: LoRABatchSource | None,
        max_blocks_per_seq: int,
        max_num_seqs: int,
    ) -> None:
        # (no reference back to the runner: a cycle would outlive the engine until a collection)
        self.model, self.adapters = model, adapters
        self.max_blocks_per_seq, self.max_num_seqs = max_blocks_per_seq, max_num_seqs
        self.decode: dict[int, torch.cuda.CUDAGraph] = {}  # by batch size, ascending
        self.mixed: dict[int, torch.cuda.CUDAGraph] = {}  # by token count, ascending
        self._twins: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}  # base-only twins
        self._out: dict[tuple[str, int, bool], torch.Tensor] = {}
        self._pool: Any = None  # the graphs' shared memory pool, once the first is captured
        # sampled tokens [rows] int64 (None until captured); each graph's per-row source column
        # (a row of `tokens`, or -1: the row's own input id) by kind
        self.tokens: torch.Tensor | None = None
        self._source: dict[str, torch.Tensor] = {}

    def _buffers(self, tokens: int, seqs: int) -> ForwardBatch:
        dev = self.model.device
        return ForwardBatch(
            input_ids=torch.zeros(tokens, dtype=torch.int64, device=dev),
            positions=torch.zeros(tokens, dtype=torch.int64, device=dev),
            slot_mapping=torch.zeros(tokens, dtype=torch.int64, device=dev),
            block_tables=torch.zeros((seqs, self.max_blocks_per_seq), dtype=torch.int32, device=dev),
            context_lens=torch.ones(seqs, dtype=torch.int32, device=dev),
            logits_indices=torch.arange(seqs, dtype=torch.int64, device=dev),
            token_slots=torch.full((tokens,), -1, dtype=torch.int32, device=dev),
            prefill_query_start=torch.zeros(seqs + 1, dtype=torch.int32, device=dev),
        )

    def capture(self, batch_sizes: list[int], token_counts: list[int]) -> None:
        """Decode graphs for `batch_sizes`, graphs of steps with prefill chunks for `token_counts`
        (largest first, so the shared pool is sized by the first)."""
        # (a collection could free CUDA objects held in reference cycles, an earlier engine's
        # graphs say, and freeing a graph while a stream captures breaks the capture)
        with no_collections():
            self._capture_all(batch_sizes, token_counts)
        log.info(
            "captured CUDA graphs for decode batch sizes %s and for steps with prefill chunks of up to "
            "%s tokens",
            list(self.decode),
            list(self.mixed),
        )

    def _capture_all(self, batch_sizes: list[int], token_counts: list[int]) -> None:
        dev = self.model.device
        rows = max([self.max_num_seqs, *batch_sizes])
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=dev)
        if batch_sizes:
            b_max = max(batch_sizes)
            self._decode_static = self._buffers(b_max, b_max)
            self._source["decode"] = torch.full((b_max,), -1, dtype=torch.int64, device=dev)
            for b in sorted(batch_sizes, reverse=True):
                self._capture("decode", b, self._decode_view(b))
        if token_counts:
            t_max = max(token_counts)
            self._mixed_static = self._buffers(t_max, mixed_segments(t_max, self.max_num_seqs))
            self._source["mixed"] = torch.full((t_max,), -1, dtype=torch.int64, device=dev)
            for t in sorted(token_counts, reverse=True):
                self._capture("mixed", t, self._mixed_view(t))
        self.decode = dict(sorted(self.decode.items()))
        self.mixed = dict(sorted(self.mixed.items()))

    def holds(self, tokens: torch.Tensor | None) -> bool:
        """Whether `tokens` (a step's sampled tokens) are the start of the static buffer."""
        return tokens is not None and self.tokens is not None and tokens.data_ptr() == self.tokens.data_ptr()

    def _forward(self, kind: str, batch: ForwardBatch) -> torch.Tensor:
        assert self.tokens is not None
        n = batch.num_tokens
        src = self._source[kind][:n]
        ids = torch.where(src >= 0, self.tokens[src.clamp(min=0)], batch.input_ids)
        hidden = self.model(dataclasses.replace(batch, input_ids=ids))
        if kind == "decode":
            logits = self.model.compute_logits(hidden)
            greedy(logits, self.tokens[:n])  # the greedy choices, in place
            return logits
        return hidden[batch.logits_indices]

    def _capture(self, kind: str, size: int, batch: ForwardBatch) -> None:
        for lora in (True, False) if self.adapters is not None else (False,):
            with torch.inference_mode():
                for _ in range(2):  # warm up (Triton compiles) outside the capture
                    batch.lora = self._lora(batch, lora)
                    self._forward(kind, batch)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._pool):
                    batch.lora = self._lora(batch, lora)
                    self._out[(kind, size, lora)] = self._forward(kind, batch)
            self._pool = g.pool()
            if lora or self.adapters is None:
                (self.decode if kind == "decode" else self.mixed)[size] = g
            else:
                self._twins[(kind, size)] = g

    def _lora(self, batch: ForwardBatch, lora: bool) -> LoRABatch | None:
        return self.adapters.lora_batch(batch.token_slots) if lora and self.adapters is not None else None

    @staticmethod
    def _view(s: ForwardBatch, tokens: int, seqs: int, **step: Any) -> ForwardBatch:
        """The first `tokens` rows and `seqs` sequences of the static buffers `s`."""
        return ForwardBatch(
            input_ids=s.input_ids[:tokens],
            positions=s.positions[:tokens],
            slot_mapping=s.slot_mapping[:tokens],
            block_tables=s.block_tables[:seqs],
            context_lens=s.context_lens[:seqs],
            logits_indices=s.logits_indices[:seqs],
            token_slots=s.token_slots[:tokens],
            context_lens_cpu=[1] * seqs,
            **step,
        )

    def _decode_view(self, b: int) -> ForwardBatch:
        return self._view(self._decode_static, b, b, num_decodes=b, query_start=list(range(b + 1)))

    def _mixed_view(self, t: int) -> ForwardBatch:
        s, n = self._mixed_static, mixed_segments(t, self.max_num_seqs)
        assert s.prefill_query_start is not None
        return self._view(
            s,
            t,
            n,
            num_prefills=n,
            num_prefill_tokens=t,
            query_start=[0] * (n + 1),
            prefill_query_start=s.prefill_query_start[: n + 1],
        )

    def _graph(self, kind: str, size: int, lora: bool) -> torch.cuda.CUDAGraph:
        if lora or self.adapters is None:
            return (self.decode if kind == "decode" else self.mixed)[size]
        return self._twins[(kind, size)]

    def _fill(
        self, kind: str, batch: ForwardBatch, source: torch.Tensor | None, tokens: int, seqs: int
    ) -> None:
        """The step's inputs into the static buffers: one call (its copies run on the device), since
        each call that reaches the driver is a point where another thread may take the interpreter.
        `source`: the rows' source column (None: every row its own id, as on a tensor-parallel
        worker's other ranks, whose column stays at -1)."""
        s = self._decode_static if kind == "decode" else self._mixed_static
        dst = [s.input_ids[:tokens], s.positions[:tokens], s.slot_mapping[:tokens]]
        src = [batch.input_ids, batch.positions, batch.slot_mapping]
        if source is not None:
            dst.append(self._source[kind][:tokens])
            src.append(source)
        # columns past this step's width keep stale ids: never read, the kernels stop at context_lens
        dst += [s.block_tables[:seqs, : batch.block_tables.shape[1]], s.context_lens[:seqs]]
        src += [batch.block_tables, batch.context_lens]
        dst.append(s.token_slots[:tokens])
        src.append(batch.token_slots)
        if kind == "mixed":
            assert batch.prefill_query_start is not None and s.prefill_query_start is not None
            dst += [s.prefill_query_start[: seqs + 1], s.logits_indices[:seqs]]
            src += [batch.prefill_query_start, batch.logits_indices]
        torch._foreach_copy_(dst, src, non_blocking=True)

    def replay_decode(
        self, b: int, batch: ForwardBatch, lora: bool, source: torch.Tensor | None = None
    ) -> torch.Tensor:
        """-> logits [b, vocab] float32 of a decode-only step padded to b rows; their argmax is in
        `tokens[:b]` once it has run."""
        self._fill("decode", batch, source, b, b)
        self._graph("decode", b, lora).replay()
        return self._out[("decode", b, lora)]

    def replay_mixed(
        self, t: int, batch: ForwardBatch, lora: bool, source: torch.Tensor | None = None
    ) -> torch.Tensor:
        """-> hidden states [segments, hidden] of the sampled rows of a step padded to t tokens."""
        self._fill("mixed", batch, source, t, mixed_segments(t, self.max_num_seqs))
        self._graph("mixed", t, lora).replay()
        return self._out[("mixed", t, lora)]
