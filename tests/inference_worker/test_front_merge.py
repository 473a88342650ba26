"""A front that falls behind sends fewer, larger messages: consecutive running outputs of one
completion that queued while it was busy leave as one message (tokens and text in order, the finish
reason of the last; the text made in the front the same), never merged across completions, past a
completion's end or into the worker's own messages and statuses; a front that keeps up sends each
output as it comes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from loraserve.inference_worker.relay.deltas import mergeable, merged_run
from loraserve.inference_worker.relay.front import Front
from loraserve.v1 import worker_pb2

LENGTH = worker_pb2.FINISH_REASON_LENGTH
METHOD = "/loraserve.v1.InferenceWorker/GenerateStream"


def test_a_run_of_deltas_merges_once_and_only_within_one_completion() -> None:
    a, b = ("r", "Once", [1, 2], 0, 0), ("r", " upon", [3], 0, LENGTH)
    assert mergeable(a, b) and merged_run([a, b]) == ("r", "Once upon", [1, 2, 3], 0, LENGTH)
    assert merged_run([a]) is a
    assert not mergeable(a, ("r", "x", [3], 1, 0))  # another completion
    assert not mergeable(("r", "", [1], 0, LENGTH), ("r", "", [2], 0, 0))  # past its end


class QueuedLink:
    """A link whose call finds `ops` already queued (what piled up while the front was busy)."""

    def __init__(self, ops: list[tuple[Any, ...]], more: list[tuple[Any, ...]] = (), tokenizer=None) -> None:
        self.ops, self.more, self.cancelled = ops, list(more), None
        self.tokenizer = tokenizer
        self.queue: asyncio.Queue | None = None

    def call(self, method, request, context, text_here=False):
        self.queue = asyncio.Queue()
        for op in self.ops:
            self.queue.put_nowait(op)
        return 7, self.queue

    def done(self, key: int, cancel: bool) -> None:
        self.cancelled = cancel


class Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(f"{code.name}: {details}")


def stream(
    link: QueuedLink, paced: bool = False, out: list | None = None, request: bytes = b""
) -> list[worker_pb2.GenerateStreamResponse]:
    """The messages the front sends for one call (also into `out` as they go); `paced`: the link's
    `more` ops arrive one at a time, each after the front sent what it had (a front that keeps up)."""
    out = [] if out is None else out

    async def go():
        details = SimpleNamespace(method=METHOD)
        behavior = Front(link, core=None).service(details)  # type: ignore[arg-type]
        async for data in behavior.unary_stream(request, Context()):
            out.append(worker_pb2.GenerateStreamResponse.FromString(data))
            if paced and link.more:
                link.queue.put_nowait(link.more.pop(0))
        return out

    return asyncio.run(go())


def last(tokens: list[int]) -> tuple[str, int, bytes]:
    msg = worker_pb2.GenerateStreamResponse(request_id="r", token_ids=tokens, finish_reason=LENGTH)
    msg.usage.completion_tokens = 9
    return ("message", 7, msg.SerializeToString())


def test_queued_outputs_of_a_completion_leave_as_one_message() -> None:
    ops = [
        ("delta", 7, ("r", "a", [1], 0, 0)),
        ("delta", 7, ("r", "b", [2], 0, 0)),
        ("delta", 7, ("r", "c", [3], 0, 0)),
        ("delta", 7, ("r", "x", [10], 1, 0)),  # another completion: a message of its own
        ("delta", 7, ("r", "y", [11], 1, LENGTH)),
        ("delta", 7, ("r", "d", [4], 0, 0)),
        last([5]),  # the worker's own last message (usage): sent as it is
        ("end", 7),
    ]
    link = QueuedLink(ops)
    got = stream(link)
    assert [(m.index, list(m.token_ids), m.text, m.finish_reason) for m in got] == [
        (0, [1, 2, 3], "abc", 0),
        (1, [10, 11], "xy", LENGTH),
        (0, [4], "d", 0),
        (0, [5], "", LENGTH),
    ]
    assert got[-1].usage.completion_tokens == 9 and link.cancelled is False


def test_a_status_after_queued_outputs_still_ends_the_call() -> None:
    ops = [("delta", 7, ("r", "a", [1], 0, 0)), ("delta", 7, ("r", "b", [2], 0, 0))]
    link = QueuedLink([*ops, ("error", 7, "RESOURCE_EXHAUSTED", "full")])
    sent: list = []
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED: full"):
        stream(link, out=sent)
    assert [(list(m.token_ids), m.text) for m in sent] == [([1, 2], "ab")]  # sent before the status
    assert link.cancelled is False  # the call ended with the worker's status, nothing to cancel


def test_the_text_made_in_the_front_is_the_same_when_outputs_merge(tiny_model_dir) -> None:
    from loraserve.inference_worker.model.loader import load_tokenizer
    from tests.inference_worker.test_front_text import TEXT, worker_text

    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer.encode(TEXT).ids
    request = worker_pb2.GenerateRequest(prompt_token_ids=[1, 2]).SerializeToString()  # plain: text here
    deltas = [("delta", 7, ("r", "", [t], 0, 0)) for t in ids[:-1]]
    link = QueuedLink([*deltas, last(ids[-1:]), ("end", 7)], tokenizer=tokenizer)
    got = stream(link, request=request)
    assert len(got) == 2 and list(got[0].token_ids) == ids[:-1]  # all queued: one message, then the last
    assert "".join(m.text for m in got) == worker_text(tokenizer, ids)


def test_a_front_that_keeps_up_sends_each_output_as_it_comes() -> None:
    first = ("delta", 7, ("r", "a", [1], 0, 0))
    more = [("delta", 7, ("r", t, [i], 0, 0)) for i, t in enumerate("bcd", start=2)]
    link = QueuedLink([first], more=[*more, last([5]), ("end", 7)])
    got = stream(link, paced=True)
    assert [list(m.token_ids) for m in got] == [[1], [2], [3], [4], [5]]
