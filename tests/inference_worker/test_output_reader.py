"""The service's reader of a request's output queue: outputs that queued while the event loop was
busy come out merged, one completion at a time, in order; errors and other completions' outputs
are never merged; an output alone comes out unchanged."""

from __future__ import annotations

import asyncio

from loraserve.contract.usage import Usage
from loraserve.inference_worker.engine.sequence import FinishReason, RequestOutput, TokenLogprob
from loraserve.inference_worker.errors import WorkerError
from loraserve.inference_worker.output_reader import OutputReader, merged_run


def out(tokens: list[int], index: int = 0, **kw) -> RequestOutput:
    text = "".join(f"<{t}>" for t in tokens)
    lps = [TokenLogprob(t, -float(t)) for t in tokens]
    return RequestOutput("r", tokens, text, index=index, logprobs=lps, **kw)


def read_all(items: list[RequestOutput], n: int) -> list[RequestOutput]:
    async def go() -> list[RequestOutput]:
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        reader = OutputReader(queue)
        return [await reader.next() for _ in range(n)]

    return asyncio.run(go())


def test_queued_outputs_of_one_completion_come_out_as_one() -> None:
    usage = Usage(3, 4, 0.1, 1.0, 2.0)
    items = [
        out([1]),
        out([2, 3]),
        out([7], index=1),
        out([4], finish_reason=FinishReason.LENGTH, usage=usage, adapter_id="a", adapter_digest="d"),
    ]
    first, other, last = read_all(items, 3)
    assert (first.token_ids, first.text, first.index) == ([1, 2, 3], "<1><2><3>", 0)
    assert [lp.token_id for lp in first.logprobs] == [1, 2, 3] and first.finish_reason is None
    assert (other.token_ids, other.index) == ([7], 1)  # another completion: never merged
    assert (last.token_ids, last.finish_reason, last.usage, last.adapter_id) == (
        [4],
        FinishReason.LENGTH,
        usage,
        "a",
    )


def test_a_finishing_output_takes_what_queued_before_it_and_nothing_after() -> None:
    usage = Usage(3, 3, 0.1, 1.0, 2.0)
    items = [out([1]), out([2], finish_reason=FinishReason.STOP, usage=usage), out([9], index=1)]
    done, other = read_all(items, 2)
    assert done.token_ids == [1, 2] and done.finish_reason is FinishReason.STOP and done.last
    assert other.token_ids == [9]


def test_an_error_is_never_merged() -> None:
    err = WorkerError("gone")
    first, failed = read_all([out([1]), out([2]), RequestOutput("", [], "", error=err)], 2)
    assert first.token_ids == [1, 2] and first.error is None
    assert failed.error is err and failed.token_ids == []


def test_an_output_alone_comes_out_unchanged_and_the_reader_waits_for_the_next() -> None:
    async def go() -> list[RequestOutput]:
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        reader = OutputReader(queue)
        one = out([5])
        queue.put_nowait(one)
        got = [await reader.next()]
        waiting = asyncio.ensure_future(reader.next())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        queue.put_nowait(out([6]))
        got.append(await waiting)
        assert got[0] is one
        return got

    assert [o.token_ids for o in asyncio.run(go())] == [[5], [6]]


def test_a_run_merges_as_its_outputs_one_after_another() -> None:
    """merged_run over k outputs: the tokens, text and logprobs of all k in order, the first's id
    and index, the last's ending, usage and adapter; a run of one is that output itself."""
    usage = Usage(2, 5, 0.1, 1.0, 2.0)
    run = [
        out([1]),
        out([2, 3]),
        out([]),
        out([4], finish_reason=FinishReason.STOP, usage=usage, adapter_id="x"),
    ]
    got = merged_run(run)
    assert got.token_ids == [1, 2, 3, 4] and got.text == "<1><2><3><4>"
    assert [lp.token_id for lp in got.logprobs] == [1, 2, 3, 4]
    assert (got.request_id, got.index, got.finish_reason, got.usage, got.adapter_id) == (
        "r",
        0,
        FinishReason.STOP,
        usage,
        "x",
    )
    assert all(o.token_ids == t for o, t in zip(run, [[1], [2, 3], [], [4]], strict=True))  # inputs intact
    alone = out([9])
    assert merged_run([alone]) is alone
