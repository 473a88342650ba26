"""On CUDA, graph steps take the previous step's pending tokens inside the graph, and the sampler
keeps the greedy choices a decode graph made: the same tokens, text, endings and logprobs as the
synchronous eager engine, over a workload with chunked prefill, preemption, stop strings,
penalties, sampled rows and n > 1 (tests/inference_worker/engine/test_async_scheduling.py's), with
no graph step gathering them outside its graph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraserve.inference_worker.engine.engine import LLMEngine
from loraserve.inference_worker.engine.step_plan import StepPlan
from loraserve.inference_worker.model.loader import load_tokenizer
from tests.helpers.workers import make_engine
from tests.inference_worker.engine.test_async_scheduling import logprob_values, run, summary, workload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = [
    dict(num_blocks=64, max_num_batched_tokens=32, max_num_seqs=8),
    dict(num_blocks=8, max_num_batched_tokens=16, max_num_seqs=6),  # preemption, chunked prompts
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


def graph_engine(model_dir: Path, moved: dict[str, int], **sizes) -> LLMEngine:
    """An asynchronous engine with graphs; `moved` counts its graph steps' pending rows by kind
    (taken inside the graph: such a step carries no gather for outside it)."""
    engine = make_engine(model_dir, "cuda", async_scheduling=True, use_cuda_graphs=True, **sizes)
    engine.runner.capture_graphs()
    assert engine.runner.graphs and engine.runner.mixed_graphs
    runner_run = engine.runner.run

    def counting(plan: StepPlan, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        if plan.source is not None:
            assert plan.gather is None
            moved["mixed" if plan.mixed else "decode"] += int((plan.source >= 0).sum())
        return runner_run(plan, prev_tokens)

    engine.runner.run = counting  # type: ignore[method-assign]
    return engine


@pytest.mark.parametrize("sizes", SIZES, ids=["roomy", "preempting"])
def test_graph_steps_take_pending_tokens_in_the_graph(tiny_model_dir: Path, tok, sizes) -> None:
    reqs = workload(tiny_model_dir, tok)
    eager = make_engine(tiny_model_dir, "cuda", async_scheduling=False, use_cuda_graphs=False, **sizes)
    want = run(eager, reqs)
    moved = {"decode": 0, "mixed": 0}
    engine = graph_engine(tiny_model_dir, moved, **sizes)
    free = engine.num_free_blocks
    got = run(engine, reqs)
    for w, g in zip(want, got, strict=True):
        assert summary(g) == summary(w)
        assert logprob_values(g) == pytest.approx(logprob_values(w), rel=1e-4, abs=1e-5)
    assert moved["decode"] > 50 and moved["mixed"] > 0
    assert engine.idle and engine.num_free_blocks == free
