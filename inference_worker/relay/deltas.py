"""A streamed generation's running output as the worker sends it to its front: the fields of a
GenerateStreamResponse without logprobs or usage, as plain values, so the worker's event loop
builds no message; the front (its own interpreter) builds and serializes it. Consecutive deltas of
one completion that queued in the front while it was busy go out as one message (`merged_run`)."""

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


def mergeable(a: Delta, b: Delta) -> bool:
    """Whether `b` continues `a`: the same completion, `a` not ended."""
    return b[3] == a[3] and not a[4]


def merged_run(run: list[Delta]) -> Delta:
    """Consecutive deltas of one completion, each mergeable into the one before, as one: built
    once rather than pair by pair (as output_reader.merged_run, for the worker's outputs)."""
    if len(run) == 1:
        return run[0]
    first = run[0]
    return (first[0], "".join([d[1] for d in run]), [t for d in run for t in d[2]], first[3], run[-1][4])
