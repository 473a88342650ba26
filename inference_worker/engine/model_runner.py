"""Turns a scheduled batch into one model call: plans the batch on the host (`StepPlan`), builds
the `ForwardBatch`, owns the paged KV cache (allocated once), and replays CUDA graphs: for
decode-only steps at bucketed batch sizes, and for steps with prefill chunks at bucketed token
counts.

A step with prefill chunks runs, on CUDA, as prefill segments only: each decode row is a segment
of one token, so one paged-prefill launch per layer attends for every row and the step's shape is
its token and segment counts alone. Padded to a bucket (tokens that belong to no segment, segments
of no tokens), such a step replays a captured graph instead of launching each kernel from Python;
larger steps, and those of a tensor-parallel leader, run eagerly.
"""

from __future__ import annotations

import array
import logging

import torch

from loraserve.inference_worker.engine.cuda_graphs import StepGraphs, mixed_segments
from loraserve.inference_worker.engine.scheduler import ScheduledBatch
from loraserve.inference_worker.engine.sequence import Sequence
from loraserve.inference_worker.engine.step_plan import LoRABatchSource, StepPlan
from loraserve.inference_worker.engine.table_rows import TableRows
from loraserve.inference_worker.engine.transfer import StepInputs, to_device
from loraserve.inference_worker.model.forward_batch import ForwardBatch
from loraserve.inference_worker.model.llama import LlamaModel

log = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# token counts of the graphs for steps with prefill chunks (capped by the step's token budget).
# A step replays the smallest that holds it and its padding rows go through every GEMM: past ~256
# tokens a 1B step's time grows with its rows (benchmarks/bench_step_tokens.py), so the counts are
# 64 apart up to 512 and 128 / 256 apart above, each faster than the next on an H100
MIXED_GRAPH_TOKENS = (64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)


def _host_tensor(code: str, values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of `values` (a few times faster than torch.tensor on a long list of ints)."""
    return torch.frombuffer(array.array(code, values), dtype=dtype) if values else torch.empty(0, dtype=dtype)


def _gather(first: int, d_source: list[int]) -> torch.Tensor:
    """An eager step's gather: [2, n] (the rows to fill, the previous step's rows they take)."""
    dst = [first + i for i, src in enumerate(d_source) if src >= 0]
    src = [src for src in d_source if src >= 0]
    return _host_tensor("q", dst + src, torch.int64).view(2, -1)


def _source_column(first: int, decode_sources: list[int], tail: int) -> torch.Tensor:
    """A graph step's source column (StepPlan.source): -1 for its `first` rows (prefill tokens),
    each decode row's source, -1 for the `tail` rows after them (padding); through C arrays."""
    column = array.array("q", [-1]) * first
    column.extend(decode_sources)
    column += array.array("q", [-1]) * tail
    return torch.frombuffer(column, dtype=torch.int64) if column else torch.empty(0, dtype=torch.int64)


def cache_slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The KV cache slots of positions [start, end) of a sequence with block table `table`:
    table[p // block_size] * block_size + p % block_size, a run of consecutive slots per block."""
    out: list[int] = []
    p = start
    while p < end:
        block, offset = divmod(p, block_size)
        take = min(block_size - offset, end - p)
        first = table[block] * block_size + offset
        out += range(first, first + take)
        p += take
    return out


def kv_bytes_per_block(model: LlamaModel, block_size: int) -> int:
    cfg = model.config  # model.num_kv_heads: this process's share under tensor parallelism
    return 2 * cfg.num_layers * block_size * model.num_kv_heads * cfg.head_dim * model.dtype.itemsize


class ModelRunner:
    # True where a step's layers hold collectives that every rank must enter (a tensor-parallel
    # leader): then only whole steps, which it announces to the other ranks, may run
    sharded = False

    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        use_cuda_graphs: bool,
        adapters: LoRABatchSource | None = None,
        max_num_batched_tokens: int = MIXED_GRAPH_TOKENS[-1],
    ) -> None:
        self.model, self.device = model, model.device
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_blocks_per_seq = (max_model_len + block_size - 1) // block_size
        self.adapters = adapters
        cfg = model.config
        shape = (num_blocks, block_size, model.num_kv_heads, cfg.head_dim)
        # k_cache, v_cache per layer: [num_blocks, block_size, nkv, d]
        self.kv_cache = torch.zeros((cfg.num_layers, 2, *shape), dtype=model.dtype, device=self.device)
        for i, layer in enumerate(model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        if self.device.type == "cuda":
            from loraserve.inference_worker.model.decode_attention import paged_decode_attention

            for layer in model.layers:
                layer.self_attn.decode_attention = paged_decode_attention
        # on CUDA, steps with prefill chunks run their decode rows as one-token prefill segments
        self.unified = self.device.type == "cuda" and not self.sharded
        self._inputs = StepInputs(self.device)  # the step's host tensors to the device, one copy
        self._table_rows = TableRows()  # the block tables' int32 rows, kept from step to step
        self._graphs = StepGraphs(model, adapters, self.max_blocks_per_seq, max_num_seqs)
        # captured once, by capture_graphs() when the engine starts; until then steps run eagerly
        self._want_graphs = use_cuda_graphs and self.device.type == "cuda"
        self._argmax_of: torch.Tensor | None = None  # the last decode graph's logits (token_buffer)

    # ----------------------------------------------------------------------------- batch building
    def plan(
        self, sched: ScheduledBatch, pad_to: int | None, mixed: int | None = None
    ) -> tuple[StepPlan, list[Sequence]]:
        """The step's batch on the host (what rank 0 sends a tensor-parallel worker's followers).
        `pad_to`: a decode-only step padded to that many rows; `mixed`: a step with prefill chunks
        padded to that many tokens (and min(mixed, max_num_seqs) segments)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        query_start, ctx_lens, tables, seq_slots, token_slots = [0], [], [], [], []
        table_keys: list[int | None] = []  # each table's sequence (None: a padding row's)
        logits_idx: list[int] = []
        sample_seqs: list[Sequence] = []
        # per decode row: the row of the previous step whose sampled token is its input (-1: none)
        d_source: list[int] = []
        n_pending = 0

        for seq, n in sched.prefills:
            start, table = seq.num_computed_tokens, seq.block_table
            ids += seq.tokens_between(start, start + n)
            pos += range(start, start + n)
            slots += cache_slots(table, start, start + n, bs)
            token_slots.extend([seq.lora_slot] * n)
            query_start.append(len(ids))
            ctx_lens.append(start + n)
            tables.append(table)
            table_keys.append(seq.seq_id)
            seq_slots.append(seq.lora_slot)
            if start + n == seq.num_tokens:  # the chunk reaches the end: next-token logits needed
                logits_idx.append(len(ids) - 1)
                sample_seqs.append(seq)
        decodes = sched.decodes  # one token each: the last one, not yet in the cache
        first = len(ids)
        for seq in decodes:
            if seq.num_pending:  # sampled by the step still running: read on the device
                d_source.append(seq.pending_row)
                n_pending += 1
                ids.append(0)
            else:
                d_source.append(-1)
                ids.append(seq.output_token_ids[-1] if seq.output_token_ids else seq.prompt_token_ids[-1])
        d_pos = [seq.num_computed_tokens for seq in decodes]
        d_tables = [seq.block_table for seq in decodes]
        pos += d_pos
        slots += [t[p // bs] * bs + p % bs for p, t in zip(d_pos, d_tables, strict=True)]
        d_slots = [seq.lora_slot for seq in decodes]
        token_slots += d_slots
        seq_slots += d_slots
        end = first + len(decodes)
        logits_idx += range(first, end)
        query_start += range(first + 1, end + 1)
        ctx_lens += [p + 1 for p in d_pos]
        tables += d_tables
        table_keys += [seq.seq_id for seq in decodes]
        sample_seqs.extend(decodes)
        num_sampled = len(logits_idx)
        n_real = len(query_start) - 1
        unified = self.unified and bool(sched.prefills)
        n_pre = n_real if unified else len(sched.prefills)
        num_prefill_tokens = query_start[n_pre]
        width = max(len(t) for t in tables)  # graph replays copy into the first `width` columns
        if pad_to:  # padding rows: token 0 at position 0 writing the reserved block 0
            extra = pad_to - len(ids)
            ids += [0] * extra
            pos += [0] * extra
            slots += [0] * extra
            ctx_lens += [1] * extra
            tables += [[0]] * extra
            table_keys += [None] * extra
            token_slots += [-1] * extra
            logits_idx += range(len(logits_idx), pad_to)
        elif mixed:  # tokens in no segment and segments of no tokens, on the reserved block 0
            extra, n_segs = mixed - len(ids), mixed_segments(mixed, self.max_num_seqs)
            segs = n_segs - n_real
            ids += [0] * extra
            pos += [0] * extra
            slots += [0] * extra
            token_slots += [-1] * extra
            query_start += [query_start[-1]] * segs
            ctx_lens += [1] * segs
            tables += [[0]] * segs
            table_keys += [None] * segs
            logits_idx += [0] * (n_segs - len(logits_idx))  # one row a segment at the most
            n_pre, num_prefill_tokens = n_pre + segs, mixed
        n_tok, n_seq, n_log = len(ids), len(ctx_lens), len(logits_idx)
        # two host buffers, one copy each: int64 [ids | pos | slots | logits_idx],
        # int32 [ctx | slots | prefill query starts | tables]
        h64 = _host_tensor("q", ids + pos + slots + logits_idx, torch.int64)
        head = ctx_lens + token_slots + query_start[: n_pre + 1]
        h32 = torch.frombuffer(self._table_rows.pack(head, table_keys, tables, width), dtype=torch.int32)
        plan = StepPlan(
            h64=h64,
            h32=h32,
            num_tokens=n_tok,
            num_seqs=n_seq,
            num_logits=n_log,
            width=width,
            num_prefills=n_pre,
            num_prefill_tokens=num_prefill_tokens,
            bucket=pad_to or 0,
            num_sampled=num_sampled,
            query_start=query_start,
            context_lens_cpu=ctx_lens[: len(query_start) - 1],
            seq_slots=seq_slots,
            pending=n_pending > 0,
            # an eager step gathers its pending inputs; a graph step's graph takes them itself
            gather=_gather(first, d_source) if n_pending and not (pad_to or mixed) else None,
            source=_source_column(first, d_source, n_tok - end) if pad_to or mixed else None,
            mixed=mixed or 0,
        )
        return plan, sample_seqs

    def to_device(self, plan: StepPlan) -> ForwardBatch:
        return self._to_device(plan)[0]

    def _to_device(self, plan: StepPlan) -> tuple[ForwardBatch, torch.Tensor | None, torch.Tensor | None]:
        """The step's batch on the device, and its gather rows and source column (StepPlan.gather,
        .source) there: one copy."""
        n_tok, n_seq, n_log, n_pre = plan.num_tokens, plan.num_seqs, plan.num_logits, plan.num_prefills
        extra = [t for t in (plan.gather, plan.source) if t is not None]
        h64, h32, *rest = self._inputs.to_device(plan.h64, plan.h32, *extra)
        gather = rest.pop(0) if plan.gather is not None else None
        source = rest.pop(0) if plan.source is not None else None
        batch = ForwardBatch(
            input_ids=h64[:n_tok],
            positions=h64[n_tok : 2 * n_tok],
            slot_mapping=h64[2 * n_tok : 3 * n_tok],
            logits_indices=h64[3 * n_tok : 3 * n_tok + n_log],
            context_lens=h32[:n_seq],
            token_slots=h32[n_seq : n_seq + n_tok],
            block_tables=h32[n_seq + n_tok + n_pre + 1 :].view(n_seq, plan.width),
            num_prefills=plan.num_prefills,
            num_prefill_tokens=plan.num_prefill_tokens,
            num_decodes=n_seq - plan.num_prefills,
            query_start=plan.query_start,
            context_lens_cpu=plan.context_lens_cpu,
            seq_slots=plan.seq_slots,
            prefill_query_start=h32[n_seq + n_tok : n_seq + n_tok + n_pre + 1] if n_pre else None,
        )
        return batch, gather, source

    def build_batch(self, sched: ScheduledBatch, pad_to: int | None) -> tuple[ForwardBatch, list[Sequence]]:
        plan, sample_seqs = self.plan(sched, pad_to)
        return self.to_device(plan), sample_seqs

    # ------------------------------------------------------------------------------- execution
    @torch.inference_mode()
    def execute(
        self, sched: ScheduledBatch, prev_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[Sequence]]:
        """Runs one step; -> (logits [N, V] float32, the N sequences they belong to).
        `prev_tokens`: the tokens sampled by the step before, still on the device, which the
        decode rows of sequences with a pending token take as input."""
        n = len(sched.decodes)
        if not sched.prefills:
            plan, sample_seqs = self.plan(sched, pad_to=next((b for b in self.graphs if b >= n), None))
        else:
            tokens = n + sum(k for _, k in sched.prefills)
            # (a graph has min(t, max_num_seqs) segments: the scheduler runs no more sequences)
            fits = n + len(sched.prefills) <= self.max_num_seqs
            mixed = next((t for t in self.mixed_graphs if t >= tokens), None) if fits else None
            plan, sample_seqs = self.plan(sched, pad_to=None, mixed=mixed)
        return self.run(plan, prev_tokens), sample_seqs

    @torch.inference_mode()
    def run(self, plan: StepPlan, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One model call on a planned batch: a graph replay for a padded decode batch, else eager;
        -> logits [plan.num_sampled, V] float32."""
        if plan.pending and prev_tokens is None:
            raise ValueError("the step reads tokens of a previous step that were not given")
        if plan.pending and plan.source is not None and not self._graphs.holds(prev_tokens):
            # (the scheduler keeps a step's rows within max_num_seqs, the buffer's size)
            raise RuntimeError("a graph step's pending tokens are not in the graphs' token buffer")
        batch, g, source = self._to_device(plan)
        self._argmax_of = None
        if g is not None:  # an eager step: its pending inputs from the previous step's tokens
            assert prev_tokens is not None
            batch.input_ids[g[0]] = prev_tokens[g[1]]
        lora = self.adapters is not None and any(s >= 0 for s in batch.seq_slots)
        # graphs captured with the LoRA path prepare the LoRA batch from token_slots themselves;
        # steps without adapter rows replay graphs without it
        if plan.bucket:
            logits = self._graphs.replay_decode(plan.bucket, batch, lora, source)[: plan.num_sampled]
            self._argmax_of = logits
            return logits
        if plan.mixed:
            hidden = self._graphs.replay_mixed(plan.mixed, batch, lora, source)[: plan.num_sampled]
            return self.model.compute_logits(hidden)
        if lora:
            assert self.adapters is not None
            batch.lora = self.adapters.lora_batch(batch.token_slots)
        hidden = self.model(batch)
        return self.model.compute_logits(hidden[batch.logits_indices])

    def token_buffer(self, logits: torch.Tensor, n: int) -> tuple[torch.Tensor | None, bool]:
        """Where a step's n sampled tokens go on the device: the graphs' buffer, from which the next
        step's graph takes its pending inputs (None: off the graphs, or more rows than it holds); and
        whether it holds the greedy choices of `logits` already (a decode graph computed them)."""
        buf = self._graphs.tokens
        if buf is None or n > buf.numel():
            return None, False
        return buf[:n], logits is self._argmax_of

    @torch.inference_mode()
    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """KV of blocks src[i] -> dst[i] in every layer (queued after the step that wrote them)."""
        s = to_device(src, self.device)
        d = to_device(dst, self.device)
        self.kv_cache[:, :, d] = self.kv_cache[:, :, s]  # [layers, 2, blocks, block_size, nkv, d]

    def close(self) -> None:
        """Release what outlives the engine's step thread (nothing here; a tensor-parallel leader
        stops its followers)."""

    @property
    def graphs(self) -> dict[int, torch.cuda.CUDAGraph]:
        """The decode-only steps' graphs by batch size (empty until captured)."""
        return self._graphs.decode

    @property
    def mixed_graphs(self) -> dict[int, torch.cuda.CUDAGraph]:
        """The graphs of steps with prefill chunks by token count (empty until captured)."""
        return self._graphs.mixed

    def capture_graphs(self) -> None:
        """Capture the step graphs if this runner uses them and has none yet (idempotent)."""
        if self._want_graphs and not self.graphs:
            self._capture_graphs()

    # ------------------------------------------------------------------------------ CUDA graphs
    def _capture_graphs(self) -> None:
        sizes = [b for b in GRAPH_BATCH_SIZES if b <= self.max_num_seqs]
        if self.max_num_seqs not in sizes and self.max_num_seqs < GRAPH_BATCH_SIZES[-1]:
            sizes.append(self.max_num_seqs)
        tokens: list[int] = []
        if self.unified:  # steps with prefill chunks, up to the step's token budget
            tokens = [t for t in MIXED_GRAPH_TOKENS if t < self.max_num_batched_tokens]
            if self.max_num_batched_tokens <= MIXED_GRAPH_TOKENS[-1]:
                tokens.append(self.max_num_batched_tokens)
        self._graphs.capture(sizes, tokens)
