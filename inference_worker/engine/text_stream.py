"""Incremental detokenization with stop strings that may span token boundaries.

Text is released only once it is final: a token that ends inside a multi-byte character waits
for the next one, and the last `max(len(stop)) - 1` characters are held back while they could
still be the start of a stop string. A matched stop string and everything after it is dropped.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # decoded output so far (final characters only)
        self.sent = 0  # characters of `text` already released
        self._prefix = 0  # token offsets of the incremental decode window
        self._read = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def append(self, token_id: int) -> bool:
        """Add a generated token; returns True when a stop string matched (text is cut there)."""
        self.token_ids.append(token_id)
        window = self._decode(self.token_ids[self._prefix :])
        if window.endswith("\ufffd"):
            return False  # inside a multi-byte character: wait for more tokens
        before = self._decode(self.token_ids[self._prefix : self._read])
        new = window[len(before) :]
        self._prefix, self._read = self._read, len(self.token_ids)
        start = max(0, len(self.text) - self.holdback)
        self.text += new
        if self.stop:
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return True
        return False

    def take(self, final: bool) -> str:
        """Text released since the last call; everything left when `final`."""
        if final and not self.stopped and self._read < len(self.token_ids):
            window = self._decode(self.token_ids[self._prefix :])
            self.text += window[len(self._decode(self.token_ids[self._prefix : self._read])) :]
            self._read = len(self.token_ids)
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.holdback)
        out = self.text[self.sent : end]
        self.sent = end
        return out
