"""The benchmarks' stand-in tokenizer for random-weight models: any vocabulary size, every id a
word, and the engine's incremental detokenization takes it without falling back."""

from __future__ import annotations

import logging

from loraserve.inference_worker.engine.text_stream import TextStream
from loraserve.inference_worker.model.tiny import word_tokenizer


def test_every_id_decodes_to_its_word_incrementally(caplog) -> None:
    tok = word_tokenizer(1000)
    assert tok.get_vocab_size() == 1000
    assert tok.decode([5, 17, 999]) == "w5 w17 w999"
    stream = TextStream(tok)
    with caplog.at_level(logging.WARNING):
        for i in (3, 0, 998, 42):
            assert not stream.append(i)
    assert stream.take(final=True) == "w3 w0 w998 w42"
    assert not caplog.records  # DecodeStream took it: no fallback to decoding by hand
