"""A request's outputs as the service takes them from its queue: what queued while the event loop
was busy comes out as one output (same completion, tokens, text and logprobs in order, the later
one's ending), so a loop that falls behind sends fewer, larger messages instead of falling further
behind. When the loop keeps up, each output comes out as the engine produced it."""

from __future__ import annotations

import asyncio

from loraserve.inference_worker.engine.sequence import RequestOutput
from loraserve.inference_worker.run_reader import RunReader


def merged_run(run: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one completion, each mergeable into the one before, as one: built
    once rather than pair by pair (a loop behind by k steps merges k outputs per stream)."""
    if len(run) == 1:
        return run[0]
    first, last = run[0], run[-1]
    return RequestOutput(
        first.request_id,
        [t for out in run for t in out.token_ids],
        "".join([out.text for out in run]),
        last.finish_reason,
        last.usage,
        last.error,
        last.adapter_id,
        last.adapter_digest,
        first.index,
        [lp for out in run for lp in out.logprobs],
    )


def mergeable(a: RequestOutput, b: RequestOutput) -> bool:
    """Whether `b` may be merged into `a` (it follows it): one completion, `a` not ended, no error."""
    return b.index == a.index and not a.finished and a.error is None and b.error is None


class OutputReader(RunReader[RequestOutput]):
    def __init__(self, queue: asyncio.Queue[RequestOutput]) -> None:
        super().__init__(queue, mergeable, merged_run)
