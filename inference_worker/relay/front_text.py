"""The text of a relayed stream, made in the front from the tokens the worker sends.

Detokenizing every token is a large share of the worker's step thread. For a streamed generation
without stop strings or logprobs the text depends on nothing but its tokens, so the front (an
interpreter of its own) makes it: the worker sends its tokenizer once per connection and, for the
calls the front marks, outputs with tokens only (`SamplingParams.detokenize` False). The front
runs the worker's own TextStream over each completion's tokens, so the text is the same, character
for character, as the worker's would have been."""

from __future__ import annotations

from tokenizers import Tokenizer

from loraserve.inference_worker.engine.text_stream import TextStream
from loraserve.inference_worker.relay.deltas import Delta, delta_message
from loraserve.v1 import worker_pb2


def text_from_tokens(sampling: worker_pb2.SamplingParams) -> bool:
    """Whether a stream's text can be made from its tokens alone: no stop strings (those cut the
    generation where the text matches), no logprobs (their messages carry each token's text,
    made on the worker)."""
    return not sampling.stop and not sampling.logprobs


def text_in_front(request: bytes) -> bool:
    """Whether the front may make a GenerateStream request's text; a request that does not parse
    is the worker's to refuse."""
    try:
        parsed = worker_pb2.GenerateRequest.FromString(request)
    except Exception:
        return False
    return text_from_tokens(parsed.sampling)


class StreamText:
    """One relayed stream's text: a TextStream per completion, fed its messages' tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._completions: dict[int, tuple[TextStream, list[int]]] = {}

    def text(self, index: int, token_ids: list[int], final: bool) -> str:
        """The text that a completion's new tokens release (all that is left when `final`)."""
        got = self._completions.get(index)
        if got is None:
            got = self._completions[index] = (TextStream(self.tokenizer), [])
        stream, ids = got
        ids += token_ids
        stream.feed(ids)
        return stream.take(final)

    def delta(self, delta: Delta) -> bytes:
        request_id, _, token_ids, index, finish = delta
        return delta_message(
            (request_id, self.text(index, token_ids, bool(finish)), token_ids, index, finish)
        )

    def message(self, data: bytes) -> bytes:
        """A message the worker built (the stream's last, with its usage), its text filled in."""
        msg = worker_pb2.GenerateStreamResponse.FromString(data)
        msg.text = self.text(msg.index, list(msg.token_ids), msg.finish_reason != 0)
        return msg.SerializeToString()
