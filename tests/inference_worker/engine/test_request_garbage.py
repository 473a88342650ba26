"""A finished request leaves no reference cycle behind: its sequences, their token lists and text
streams are freed by reference counts when it ends, not by the garbage collector, whose collections
of them stopped every thread of the worker for 10-20 ms each under load (n > 1, stop strings and
aborted requests included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraserve.inference_worker.engine.sequence import RequestOutput, SamplingParams, Sequence, SequenceGroup
from loraserve.inference_worker.model.loader import load_tokenizer
from tests.helpers.saved_garbage import garbage, saving_garbage
from tests.helpers.workers import make_engine
from tests.inference_worker.engine.test_async_scheduling import run, workload


@pytest.fixture
def saved_garbage():
    """Collections off; what a collection then finds unreachable is kept in gc.garbage."""
    with saving_garbage():
        yield


def _engine_garbage() -> list[str]:
    return garbage(lambda o: isinstance(o, Sequence | SequenceGroup))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_finished_requests_leave_no_cycles(
    tiny_model_dir: Path, async_scheduling: bool, saved_garbage
) -> None:
    tok = load_tokenizer(tiny_model_dir)
    reqs = workload(tiny_model_dir, tok)  # (n > 1, stop strings and tokens, penalties, logprobs)
    engine = make_engine(tiny_model_dir, async_scheduling=async_scheduling)
    _engine_garbage()  # (what building the engine left)
    outs = run(engine, reqs)
    assert all(o[-1].last for o in outs)
    assert _engine_garbage() == []
    # an aborted request, while its step is in flight
    got: list[RequestOutput] = []
    engine.submit(engine.make_sequence("long", "", [5, 6, 7], SamplingParams(max_tokens=200), got.append))
    for _ in range(4):
        engine.step()
    engine.abort("long")
    while not (got and got[-1].last):
        engine.step()
    engine.step()
    assert _engine_garbage() == []
