"""Engine outputs -> GenerateResponse / GenerateStreamResponse, with n completions and logprobs."""

from __future__ import annotations

from collections.abc import Callable

from loraserve.inference_worker.engine.sequence import FinishReason, RequestOutput, TokenLogprob
from loraserve.inference_worker.relay.deltas import Delta
from loraserve.v1 import worker_pb2

FINISH = {
    FinishReason.LENGTH: worker_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: worker_pb2.FINISH_REASON_STOP,
    FinishReason.EOS: worker_pb2.FINISH_REASON_EOS,
    FinishReason.CANCELLED: worker_pb2.FINISH_REASON_CANCELLED,
}

TokenText = Callable[[int], tuple[str, bytes]]  # token id -> (text, bytes)


def logprobs_to_pb(lps: list[TokenLogprob], token_text: TokenText) -> list[worker_pb2.TokenLogprob]:
    out = []
    for lp in lps:
        text, raw = token_text(lp.token_id)
        pb = worker_pb2.TokenLogprob(token_id=lp.token_id, token=text, logprob=lp.logprob, token_bytes=raw)
        for tid, value in lp.top:
            t, b = token_text(tid)
            pb.top_logprobs.add(token_id=tid, token=t, logprob=value, token_bytes=b)
        out.append(pb)
    return out


def _empty(out: RequestOutput) -> bool:
    """A delta that adds nothing and ends nothing: no message."""
    return out.finish_reason is None and not out.text and not out.token_ids


def stream_delta(out: RequestOutput) -> Delta | None:
    """A running output without logprobs or usage as the fields the relay's front builds its
    message from (relay/deltas.py); None for an empty one."""
    if _empty(out):
        return None
    finish = FINISH[out.finish_reason] if out.finish_reason is not None else 0
    return out.request_id, out.text, out.token_ids, out.index, finish


def stream_message(out: RequestOutput, token_text: TokenText) -> worker_pb2.GenerateStreamResponse | None:
    """One stream message for an output; None for an empty delta that ends nothing."""
    if _empty(out):
        return None
    msg = worker_pb2.GenerateStreamResponse(
        request_id=out.request_id,
        text=out.text,
        token_ids=out.token_ids,
        index=out.index,
        logprobs=logprobs_to_pb(out.logprobs, token_text),
    )
    if out.finish_reason is not None:
        msg.finish_reason = FINISH[out.finish_reason]
    if out.usage is not None:
        msg.usage.CopyFrom(out.usage.to_pb())
    return msg


class ResponseBuilder:
    """Collects a request's outputs, by completion index, into one GenerateResponse."""

    def __init__(self, request_id: str, token_text: TokenText) -> None:
        self.request_id, self.token_text = request_id, token_text
        self._text: dict[int, list[str]] = {}
        self._completions: dict[int, worker_pb2.Completion] = {}
        self._last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.request_id = out.request_id
        c = self._completions.get(out.index)
        if c is None:
            c = self._completions[out.index] = worker_pb2.Completion(index=out.index)
            self._text[out.index] = []
        self._text[out.index].append(out.text)
        c.token_ids.extend(out.token_ids)
        c.logprobs.extend(logprobs_to_pb(out.logprobs, self.token_text))
        if out.finish_reason is not None:
            c.finish_reason = FINISH[out.finish_reason]
        self._last = out

    def response(self) -> worker_pb2.GenerateResponse:
        last = self._last
        assert last is not None and last.usage is not None
        completions = [self._completions[i] for i in sorted(self._completions)]
        for c in completions:
            c.text = "".join(self._text[c.index])
        first = completions[0]
        return worker_pb2.GenerateResponse(
            request_id=self.request_id,
            text=first.text,
            token_ids=first.token_ids,
            finish_reason=first.finish_reason,
            usage=last.usage.to_pb(),
            adapter_id=last.adapter_id,
            adapter_digest=last.adapter_digest,
            completions=completions,
        )
