"""Steps with prefill chunks as prefill segments only (the CUDA runner's form, model_runner.py): a
decode row as a one-token segment gives the tokens the split form gives, and padding such a step to
a graph's token and segment counts (tokens in no segment, segments of no tokens) changes no logit
of a real row. On the CPU, in fp32, through the reference attention; the GPU tests replay the
graphs themselves."""

from __future__ import annotations

from pathlib import Path

import torch

from loraserve.inference_worker.engine.cuda_graphs import mixed_segments
from loraserve.inference_worker.engine.engine import LLMEngine
from loraserve.inference_worker.engine.model_runner import ModelRunner
from loraserve.inference_worker.engine.scheduler import ScheduledBatch
from loraserve.inference_worker.engine.sequence import RequestOutput, SamplingParams
from loraserve.inference_worker.engine.step_plan import StepPlan
from loraserve.inference_worker.model.loader import load_tokenizer
from tests.helpers.engine_run import completions
from tests.helpers.workers import make_engine
from tests.inference_worker.engine.test_engine import PROMPTS


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    outs: list[list[RequestOutput]] = [[] for _ in prompts]
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=12 + 5 * i, ignore_eos=True)
        engine.submit(engine.make_sequence(f"r{i}", "", ids, params, outs[i].append))
    steps = 0
    while not all(o and o[-1].last for o in outs):
        engine.step()
        steps += 1
        assert steps < 1000
    return [completions(o)[0] for o in outs]


def eager_logits(runner: ModelRunner, plan: StepPlan) -> torch.Tensor:
    batch = runner.to_device(plan)
    with torch.inference_mode():
        hidden = runner.model(batch)
        return runner.model.compute_logits(hidden[batch.logits_indices])[: plan.num_sampled]


def test_decode_rows_as_segments_give_the_same_tokens(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    prompts = [tok.encode(p).ids for p in PROMPTS]
    split = make_engine(tiny_model_dir, max_num_batched_tokens=24)
    unified = make_engine(tiny_model_dir, max_num_batched_tokens=24)
    unified.runner.unified = True
    planned: list[StepPlan] = []
    plan = unified.runner.plan

    def recording(sched: ScheduledBatch, pad_to: int | None, mixed: int | None = None):
        got = plan(sched, pad_to, mixed)
        if sched.prefills and sched.decodes:
            planned.append(got[0])
        return got

    unified.runner.plan = recording  # type: ignore[method-assign]
    assert run(unified, prompts) == run(split, prompts)
    assert planned, "no step mixed prefill chunks with decodes"
    for p in planned:  # every row a prefill segment: no decode part
        assert p.num_prefills == p.num_seqs and p.num_prefill_tokens == p.num_tokens


def test_padding_a_step_to_a_graph_shape_changes_no_logit(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=24, max_num_seqs=6)
    runner = engine.runner
    runner.unified = True
    execute = runner.execute
    checked = []

    def checking(sched: ScheduledBatch, prev_tokens: torch.Tensor | None = None):
        if sched.prefills:
            tokens = len(sched.decodes) + sum(n for _, n in sched.prefills)
            plain, seqs = runner.plan(sched, None)
            for pad in (tokens, tokens + 5):
                padded, padded_seqs = runner.plan(sched, None, mixed=pad)
                assert padded_seqs == seqs
                segments = mixed_segments(pad, runner.max_num_seqs)  # the graph's shape, whatever samples
                assert (padded.num_tokens, padded.num_seqs, padded.num_logits) == (pad, segments, segments)
                torch.testing.assert_close(
                    eager_logits(runner, padded), eager_logits(runner, plain), rtol=1e-5, atol=1e-5
                )
            checked.append(len(sched.decodes))
        return execute(sched, prev_tokens)

    runner.execute = checking  # type: ignore[method-assign]
    run(engine, [tok.encode(p).ids for p in PROMPTS])
    assert any(checked), "no step with prefill chunks had decode rows"
