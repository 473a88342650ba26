"""What a graph step takes from the step before it on the device (cuda_graphs.py): the plan's source
column names, for each row, the same previous-step row as the eager gather does, and nothing else;
the graph's own torch ops take those rows and make a decode step's greedy choices;
the sampler writes into a given token buffer and keeps greedy choices it is told are there, unless
penalties changed the logits; no garbage collection runs while graphs are captured."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from loraserve.inference_worker.engine.cuda_graphs import StepGraphs
from loraserve.inference_worker.engine.model_runner import _source_column
from loraserve.inference_worker.engine.sampler import Sampler
from loraserve.inference_worker.engine.scheduler import ScheduledBatch
from loraserve.inference_worker.engine.sequence import SamplingParams
from loraserve.inference_worker.engine.step_plan import StepPlan
from loraserve.inference_worker.model.forward_batch import ForwardBatch
from tests.helpers.workers import make_engine
from tests.inference_worker.engine.test_sampler import _seq


def _check_source(graph: StepPlan, eager: StepPlan) -> int:
    """The graph step's column names the rows the eager step gathers, and only those (it gathers
    nothing itself); -> the rows it moves."""
    assert graph.source is not None and graph.source.shape == (graph.num_tokens,)
    assert graph.gather is None and graph.pending == eager.pending
    want = [-1] * graph.num_tokens
    if eager.gather is not None:
        for dst, src in eager.gather.T.tolist():
            want[dst] = src
    assert graph.source.tolist() == want
    return sum(1 for s in want if s >= 0)


def test_the_source_column_matches_the_gather_in_padded_and_mixed_steps(tiny_model_dir: Path) -> None:
    """Asynchronous scheduling on CPU plans real steps (prefill chunks beside decodes, pending
    tokens, padding); each one planned again as a padded decode or mixed graph step carries the
    same previous-step rows in its source column as the eager step's gather."""
    engine = make_engine(tiny_model_dir, async_scheduling=True, max_num_batched_tokens=16)
    runner, plan = engine.runner, engine.runner.plan
    moved: dict[str, int] = {"decode": 0, "mixed": 0}

    def recording(sched: ScheduledBatch, pad_to: int | None, mixed: int | None = None):
        got = plan(sched, pad_to, mixed)
        eager = got[0]
        assert eager.source is None  # (CPU: no graphs, an eager step)
        assert eager.pending == (eager.gather is not None)
        if sched.prefills:
            tokens = len(sched.decodes) + sum(n for _, n in sched.prefills)
            moved["mixed"] += _check_source(plan(sched, None, mixed=tokens + 3)[0], eager)
        else:
            moved["decode"] += _check_source(plan(sched, len(sched.decodes) + 2)[0], eager)
        return got

    runner.plan = recording  # type: ignore[method-assign]
    outs: list = []
    for i, n in enumerate((30, 12, 25)):
        prompt = list(range(3 + 7 * i, 40 + 11 * i))
        engine.submit(engine.make_sequence(f"r{i}", "", prompt, SamplingParams(max_tokens=n), outs.append))
    for _ in range(200):
        if not engine.step():
            break
    assert engine.idle
    assert moved["decode"] > 10 and moved["mixed"] > 0


def test_tokens_go_to_the_given_buffer_and_ready_greedy_choices_are_kept() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 12)
    seqs = [_seq(SamplingParams(max_tokens=8)) for _ in range(4)]
    sampler = Sampler()
    # not ready: the argmax is written into the buffer
    buf = torch.full((6,), -5, dtype=torch.int64)
    out = sampler.launch(logits, seqs, buffer=buf[:4])
    assert out.tokens.data_ptr() == buf.data_ptr()
    assert buf[:4].tolist() == logits.argmax(-1).tolist() and buf[4:].tolist() == [-5, -5]
    # ready (a decode graph computed them): kept as they are, even where they are not the argmax
    buf[:4] = torch.tensor([7, 8, 9, 10])
    sampler.launch(logits, seqs, buffer=buf[:4], argmax_ready=True)
    assert buf[:4].tolist() == [7, 8, 9, 10]
    # a penalized row changes the logits: every row's choice is made again
    seqs[1] = _seq(SamplingParams(max_tokens=8, repetition_penalty=1.5), generated=2)
    want = Sampler().apply_penalties(logits, seqs).argmax(-1)
    sampler.launch(logits, seqs, buffer=buf[:4], argmax_ready=True)
    assert buf[:4].tolist() == want.tolist()
    # a sampled row overwrites its greedy choice with its draw (the same draw as without a buffer)
    seqs = [_seq(SamplingParams(max_tokens=8)), _seq(SamplingParams(max_tokens=8, temperature=1.0, seed=3))]
    plain = Sampler().launch(logits[:2], seqs).tokens
    buf[:2] = logits[:2].argmax(-1)
    sampler.launch(logits[:2], seqs, buffer=buf[:2], argmax_ready=True)
    assert buf[:2].tolist() == plain.tolist()


def test_no_garbage_collection_while_graphs_are_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collection during a capture could free an earlier engine's graphs (held in a reference
    cycle), which breaks the capture: collections wait until it is over, or has failed."""
    graphs = StepGraphs.__new__(StepGraphs)  # (the capture itself needs CUDA)
    graphs.decode, graphs.mixed = {}, {}
    seen: list[bool] = []

    def capture_all(batch_sizes: list[int], token_counts: list[int]) -> None:
        seen.append(gc.isenabled())
        if not batch_sizes:
            raise RuntimeError("capture failed")

    monkeypatch.setattr(graphs, "_capture_all", capture_all)
    assert gc.isenabled()
    graphs.capture([1], [])
    with pytest.raises(RuntimeError, match="capture failed"):
        graphs.capture([], [])
    assert seen == [False, False] and gc.isenabled()


class _EchoModel:
    """Hidden state = the row's input id; logits put their maximum at (3 * id + 1) mod V."""

    V = 50

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        return batch.input_ids.float()[:, None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        best = (3 * hidden[:, 0].long() + 1) % self.V
        return torch.nn.functional.one_hot(best, self.V).float()


def test_a_graph_takes_its_rows_from_the_sampled_tokens_and_makes_the_greedy_choices() -> None:
    """What each graph computes before and after the model (StepGraphs._forward, plain torch, run
    here eagerly): rows with a source take that row of the token buffer as input, the others keep
    their own id; a decode graph writes its logits' argmax into the buffer."""
    graphs = StepGraphs.__new__(StepGraphs)
    graphs.model = _EchoModel()  # type: ignore[assignment]
    graphs.tokens = torch.tensor([11, 12, 13, 14, 15, 16, 17, 18])
    graphs._source = {
        "decode": torch.tensor([2, -1, 0, -1, 5, -1]),
        "mixed": torch.tensor([-1, -1, 4, -1, 1]),
    }
    ids = torch.tensor([0, 30, 0, 31, 0, 0])  # (pending rows hold 0; the last row is padding)
    batch = ForwardBatch(
        input_ids=ids, positions=ids, slot_mapping=ids, block_tables=ids[:, None], context_lens=ids,
        logits_indices=torch.tensor([1, 2, 4]), token_slots=ids,
    )  # fmt: skip
    logits = graphs._forward("decode", batch)
    taken = [13, 30, 11, 31, 16, 0]
    assert logits.argmax(-1).tolist() == [(3 * t + 1) % 50 for t in taken]
    assert graphs.tokens.tolist() == [(3 * t + 1) % 50 for t in taken] + [17, 18]
    assert ids.tolist() == [0, 30, 0, 31, 0, 0]  # (the static inputs themselves are not rewritten)
    # a step with prefill chunks: the sampled rows' hidden states; the buffer is the sampler's
    graphs.tokens = torch.tensor([11, 12, 13, 14, 15, 16, 17, 18])
    batch.input_ids = torch.tensor([7, 8, 0, 9, 0])
    batch.logits_indices = torch.tensor([2, 4])
    hidden = graphs._forward("mixed", batch)
    assert hidden[:, 0].tolist() == [15.0, 12.0]
    assert graphs.tokens.tolist() == [11, 12, 13, 14, 15, 16, 17, 18]


def test_the_source_column_of_any_size() -> None:
    assert _source_column(3, [5, -1, 0], 2).tolist() == [-1, -1, -1, 5, -1, 0, -1, -1]
    assert _source_column(0, [], 0).tolist() == []
    big = _source_column(5000, [7], 3000)
    assert big.shape == (8001,) and big[5000] == 7 and int((big == -1).sum()) == 8000
