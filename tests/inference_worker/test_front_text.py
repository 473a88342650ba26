"""The front's text of a stream is the worker's: StreamText over a stream's messages (tokens in
chunks of any size, a completion's last message final) gives what the worker's TextStream gives
over the same tokens, multi-byte characters split across tokens included; eligibility: no stop
strings, no logprobs; a tokenizer the front cannot load leaves the text to the worker."""

from __future__ import annotations

import random

from loraserve.inference_worker.engine.text_stream import TextStream
from loraserve.inference_worker.model.loader import load_tokenizer
from loraserve.inference_worker.relay.front_text import StreamText, text_in_front
from loraserve.v1 import worker_pb2

TEXT = "Once upon a time, héllo wörld: 世界 🙂 naïve café — ok."


def worker_text(tokenizer, ids: list[int]) -> str:
    stream = TextStream(tokenizer)
    out = ""
    for i in range(len(ids)):  # one token a step, as the engine feeds it
        stream.feed(ids[: i + 1])
        out += stream.take(final=False)
    return out + stream.take(final=True)


def test_chunks_of_any_size_give_the_worker_s_text(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer.encode(TEXT).ids
    rng = random.Random(3)
    ids = ids + [rng.randrange(tokenizer.get_vocab_size()) for _ in range(60)]  # and noise
    expected = worker_text(tokenizer, ids)
    assert "世界" in expected
    for seed in range(5):
        rng, text, pos = random.Random(seed), StreamText(tokenizer), 0
        pieces = []
        while pos < len(ids):
            n = rng.randint(1, 4)
            chunk, pos = ids[pos : pos + n], pos + n
            pieces.append(text.text(0, chunk, final=pos >= len(ids)))
        assert "".join(pieces) == expected


def test_messages_and_deltas_carry_the_text(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer.encode(TEXT).ids
    text = StreamText(tokenizer)
    first = worker_pb2.GenerateStreamResponse.FromString(text.delta(("r", "", ids[:5], 1, 0)))
    last = worker_pb2.GenerateStreamResponse(
        request_id="r", token_ids=ids[5:], index=1, finish_reason=worker_pb2.FINISH_REASON_LENGTH
    )
    last.usage.completion_tokens = len(ids)
    done = worker_pb2.GenerateStreamResponse.FromString(text.message(last.SerializeToString()))
    assert first.text + done.text == worker_text(tokenizer, ids)
    assert list(first.token_ids) + list(done.token_ids) == ids and done.usage.completion_tokens == len(ids)


def test_only_requests_whose_text_is_their_tokens() -> None:
    def request(**sampling) -> bytes:
        return worker_pb2.GenerateRequest(
            prompt="hi", sampling=worker_pb2.SamplingParams(**sampling)
        ).SerializeToString()

    assert text_in_front(request(max_tokens=4, temperature=0.7))
    assert not text_in_front(request(stop=["."]))
    assert not text_in_front(request(logprobs=True))
    assert not text_in_front(b"\xff\xff not a request")


def test_a_tokenizer_that_does_not_load_leaves_the_text_to_the_worker(tiny_model_dir, capsys) -> None:
    from loraserve.inference_worker.relay.front import tokenizer_from_json as front_tokenizer

    assert front_tokenizer("{not a tokenizer") is None
    assert "did not load" in capsys.readouterr().err
    worker = load_tokenizer(tiny_model_dir)
    sent = front_tokenizer(worker.to_str())
    assert sent is not None and sent.encode(TEXT).ids == worker.encode(TEXT).ids
