"""A request's outputs as the service takes them from its queue: what queued while the event loop
was busy comes out as one output (same completion, tokens, text and logprobs in order, the later
one's ending), so a loop that falls behind sends fewer, larger messages instead of falling further
behind. When the loop keeps up, each output comes out as the engine produced it."""

from __future__ import annotations

import asyncio

from loraserve.inference_worker.engine.sequence import RequestOutput


def merged(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """`a` then `b`, two consecutive outputs of one completion, as one."""
    return RequestOutput(
        a.request_id,
        a.token_ids + b.token_ids,
        a.text + b.text,
        finish_reason=b.finish_reason,
        usage=b.usage,
        error=b.error,
        adapter_id=b.adapter_id,
        adapter_digest=b.adapter_digest,
        index=a.index,
        logprobs=a.logprobs + b.logprobs,
    )


def mergeable(a: RequestOutput, b: RequestOutput) -> bool:
    """Whether `b` may be merged into `a` (it follows it): one completion, `a` not ended, no error."""
    return b.index == a.index and not a.finished and a.error is None and b.error is None


class OutputReader:
    def __init__(self, queue: asyncio.Queue[RequestOutput]) -> None:
        self.queue = queue
        self._held: RequestOutput | None = None  # taken from the queue, not merged: next

    async def next(self) -> RequestOutput:
        """The next output, merged with the ones of the same completion already queued behind it;
        an error, or another completion's output, is never merged and comes next."""
        out = self._held if self._held is not None else await self.queue.get()
        self._held = None
        while not out.finished and out.error is None and not self.queue.empty():
            nxt = self.queue.get_nowait()
            if not mergeable(out, nxt):
                self._held = nxt
                break
            out = merged(out, nxt)
        return out
