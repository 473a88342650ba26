"""Compile-ahead: every Triton kernel variant a step can launch is built before the worker serves.

Triton compiles a kernel the first time it meets a new specialization: a new constexpr (the LoRA
kernels' tile plans and split-K depth follow the step's token count), or an integer argument that
becomes 1 or a multiple of 16. Without this, a fresh worker compiles as new batch shapes arrive,
on the step thread, stalling every running sequence (measured under serving load: about 12 s of
compiles in a fresh worker's first 40 s, and still ~1 s in every 15 s at 1,000 adapters, when new
adapter mixes make new shapes). Compiled kernels land in Triton's on-disk cache, so a restart
finds them there and this costs launches only.

Two passes, both on dummy data (outputs discarded; KV writes go to the reserved block 0):

1. the LoRA path alone (slot grouping, shrink, expand) for every token count 1..max_tokens, one
   layer per module group, the gate | up group through the op the model runs at that count
   (add_lora, or add_lora_silu_mul from FUSED_SILU_MUL_MIN_ROWS rows on): a launch costs
   microseconds, so no count is skipped (not on a
   tensor-parallel worker, whose LoRA layers hold collectives: there the steps below run on
   every rank);
2. whole eager steps (base and LoRA rows) for mixes of prefill chunks and decodes that cover the
   other kernels' specializations: token and sequence counts of 1, of a multiple of 16 and of
   neither, with one and several prefill chunks; on a tensor-parallel worker also steps at the
   sizes where the LoRA kernels change plan, which pass 1 covers for the others.
"""

from __future__ import annotations

import logging
import time

import torch

from loraserve.inference_worker.engine.config import EngineConfig
from loraserve.inference_worker.engine.model_runner import ModelRunner
from loraserve.inference_worker.engine.scheduler import ScheduledBatch
from loraserve.inference_worker.engine.sequence import SamplingParams, Sequence
from loraserve.inference_worker.model.linear import GroupedLinear
from loraserve.kernels.launch_plan import FUSED_SILU_MUL_MIN_ROWS, PREFILL_ROWS

log = logging.getLogger(__name__)

# sequence and token counts of the eager-step pass: 1, a multiple of 16, and neither
COUNT_CLASSES = (1, 2, 16, 17, 32)


def _noop(_: object) -> None:
    return None


def _sequence(num_tokens: int, lora_slot: int, block_size: int) -> Sequence:
    """A sequence of `num_tokens` dummy tokens whose KV blocks are all the reserved block 0."""
    seq = Sequence(
        request_id="kernel-warmup",
        prompt_token_ids=[0] * num_tokens,
        params=SamplingParams(),
        on_output=_noop,
        text_stream=None,  # type: ignore[arg-type]  # never detokenized
    )
    seq.block_table = [0] * -(-num_tokens // block_size)
    seq.lora_slot = lora_slot
    return seq


def dummy_batch(prefills: list[tuple[int, int]], decode_slots: list[int], block_size: int) -> ScheduledBatch:
    """A step of dummy sequences on the reserved block 0: a prefill chunk per (tokens, LoRA slot) of
    `prefills`, and a decode per LoRA slot of `decode_slots` (one cached token, decoding its second)."""
    sched = ScheduledBatch()
    for n, slot in prefills:
        sched.prefills.append((_sequence(n, slot, block_size), n))
    for slot in decode_slots:
        seq = _sequence(1, slot, block_size)
        seq.num_computed_tokens = 1
        seq.output_token_ids = [0]
        sched.decodes.append(seq)
    return sched


def step_mixes(max_tokens: int, max_seqs: int) -> list[tuple[list[int], int]]:
    """(prefill chunk lengths, decodes) of the eager steps to run; each within the step's budgets
    (tokens <= max_tokens, sequences <= max_seqs)."""
    mixes: list[tuple[list[int], int]] = []
    for decodes in (0, *COUNT_CLASSES):
        for chunk in COUNT_CLASSES:
            mixes.append(([chunk], decodes))
        for prefills in COUNT_CLASSES[1:]:
            mixes.append(([3] * prefills, decodes))
    return [
        (chunks, d)
        for chunks, d in mixes
        if sum(chunks) + d <= max_tokens and len(chunks) + d <= max_seqs and (chunks or d)
    ]


def large_step_mixes(max_tokens: int, max_seqs: int, max_len: int) -> list[tuple[list[int], int]]:
    """(prefill chunk lengths, 0 decodes) of eager steps at the sizes where the LoRA kernels change
    plan (PREFILL_ROWS rows: prefill tiles; FUSED_SILU_MUL_MIN_ROWS: the fused gate | up op), a
    multiple of 16 and one more, each within the budgets, no chunk past `max_len` tokens. For
    workers whose LoRA layers the first pass cannot warm alone (tensor-parallel: collectives)."""
    mixes = []
    chunk = min(max_len, 256)
    for size in (PREFILL_ROWS, FUSED_SILU_MUL_MIN_ROWS):
        for total in (size, size + 1):
            chunks = [chunk] * (total // chunk) + ([total % chunk] if total % chunk else [])
            if total <= max_tokens and len(chunks) <= max_seqs:
                mixes.append((chunks, 0))
    return mixes


def warm_up_lora_path(runner: ModelRunner, max_tokens: int) -> int:
    """Launch the LoRA kernels of one layer per module group for every token count; -> launches."""
    adapters, model = runner.adapters, runner.model
    if adapters is None or runner.sharded:  # rank 0 alone must not enter a layer's collectives
        return 0
    # one layer per module group: x [max_tokens, in], y [max_tokens, out] (a row prefix is contiguous)
    firsts: dict[str, GroupedLinear] = {}
    for lin in model.grouped_linears().values():
        if lin.lora is not None:
            firsts.setdefault(lin.group, lin)
    if not firsts:
        return 0
    dev, dtype = runner.device, model.dtype
    bufs = {
        g: (
            torch.randn(max_tokens, lin.in_features, dtype=dtype, device=dev),
            torch.zeros(max_tokens, sum(lin.out_sizes), dtype=dtype, device=dev),
        )
        for g, lin in firsts.items()
    }
    # rows alternate between slot 0 and the base model (which variant compiles depends on sizes only)
    slots_all = torch.arange(max_tokens, device=dev, dtype=torch.int32) % 2 - 1
    launches = 0
    with torch.inference_mode():
        for t in range(1, max_tokens + 1):
            lora = adapters.lora_batch(slots_all[:t])
            for g, lin in firsts.items():
                x, y = bufs[g][0][:t], bufs[g][1][:t]
                assert lin.lora is not None
                if lin.lora.fuses_silu_mul(t):
                    # the gate | up group at this size: the model runs the fused op, not finish
                    lin.lora.silu_mul(x, y, lora)
                else:
                    begun = lin.lora.begin(x, lora)
                    y.zero_()  # stands for the base GEMM: add_lora never directly follows the prepare
                    lin.lora.finish(x, y, lora, begun)
                launches += 1
    return launches


def warm_up_steps(runner: ModelRunner, max_tokens: int, max_seqs: int, max_len: int = 0) -> int:
    """Run eager steps for the mixes of `step_mixes` (and, on a tensor-parallel worker with
    adapters, of `large_step_mixes` with sequences of up to `max_len` tokens), with and without
    adapter rows; -> steps."""
    steps = 0
    variants = (False, True) if runner.adapters is not None else (False,)
    mixes = step_mixes(max_tokens, max_seqs)
    if runner.sharded and runner.adapters is not None and max_len > 0:
        mixes += large_step_mixes(max_tokens, max_seqs, max_len)
    for chunks, decodes in mixes:
        for lora in variants:
            slot = 0 if lora else -1
            sched = dummy_batch([(n, slot) for n in chunks], [slot] * decodes, runner.block_size)
            runner.execute(sched)  # a prefill in every mix: an eager step
            steps += 1
    return steps


def before_serving(runner: ModelRunner, config: EngineConfig) -> None:
    """The engine's compile-ahead: both passes on a CUDA runner, at the engine's step budgets
    (unless `config.kernel_warmup` is off)."""
    if config.kernel_warmup and runner.device.type == "cuda":
        warm_up(runner, config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len)


def warm_up(runner: ModelRunner, max_tokens: int, max_seqs: int, max_len: int = 0) -> None:
    """Both passes, then wait for the device; logs what it did and how long it took. Short of
    device memory for the LoRA pass's dummy rows (its largest is max_tokens x the widest module
    group), it warns and goes on: the kernels then compile when traffic first needs them."""
    t0 = time.perf_counter()
    try:
        launches = warm_up_lora_path(runner, max_tokens)
    except torch.cuda.OutOfMemoryError as exc:
        log.warning("kernel warm-up of the LoRA path skipped (device memory): %s", exc)
        launches = 0
    steps = warm_up_steps(runner, max_tokens, max_seqs, max_len)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    log.info(
        "kernels compiled ahead: LoRA path at %d token counts (%d launches), %d eager steps, in %.1f s",
        max_tokens,
        launches,
        steps,
        time.perf_counter() - t0,
    )
