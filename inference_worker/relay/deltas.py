"""A streamed generation's running output as the worker sends it to its front: the fields of a
GenerateStreamResponse without logprobs or usage, as plain values, so the worker's event loop
builds no message; the front (its own interpreter) builds and serializes it. Consecutive deltas of
one completion that queued in the front while it was busy go out as one message (`merged`)."""

from __future__ import annotations

from loraserve.v1 import worker_pb2

# (request id, text, token ids, completion index, finish reason as worker_pb2.FinishReason; 0 = none)
Delta = tuple[str, str, list[int], int, int]


def delta_message(delta: Delta) -> bytes:
    """The serialized GenerateStreamResponse of a delta."""
    request_id, text, token_ids, index, finish = delta
    msg = worker_pb2.GenerateStreamResponse(
        request_id=request_id, text=text, token_ids=token_ids, index=index
    )
    if finish:
        msg.finish_reason = finish  # type: ignore[assignment]
    return msg.SerializeToString()


def merged(a: Delta, b: Delta) -> Delta | None:
    """`b` appended to `a` when it continues it (same completion, `a` not ended), else None."""
    if b[3] != a[3] or a[4]:
        return None
    return (a[0], a[1] + b[1], a[2] + b[2], a[3], b[4])
