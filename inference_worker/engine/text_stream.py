"""Incremental detokenization with stop strings that may span token boundaries.

Text is released only once it is final: a token that ends inside a multi-byte character waits
for the next one (`tokenizers`' DecodeStream does the incremental decode), and the last
`max(len(stop)) - 1` characters are held back while they could still be the start of a stop
string. A matched stop string and everything after it is dropped.
"""

from __future__ import annotations

import logging

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

log = logging.getLogger(__name__)


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.unsent = ""  # decoded text not released yet (final characters only)
        # DecodeStream's window, mirrored for the final flush: it decodes token_ids[_prefix:] and
        # the text of token_ids[:_read] has been decoded; both move on each chunk it returns
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=True)
        self._prefix = 0
        self._read = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def append(self, token_id: int) -> bool:
        """Add a generated token; returns True when a stop string matched (text is cut there)."""
        self.token_ids.append(token_id)
        new = self._step(token_id)
        if new is None:
            return False  # inside a multi-byte character: wait for more tokens
        self._prefix, self._read = self._read, len(self.token_ids)
        if not self.stop:
            self.unsent += new
            return False
        # a match ends in the new text: it starts at most `holdback` characters before it, and
        # those are never released while a stop string could begin there
        start = max(0, len(self.unsent) - self.holdback)
        self.unsent += new
        hits = [i for i in (self.unsent.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.unsent = self.unsent[: min(hits)]
            self.stopped = True
            return True
        return False

    def feed(self, token_ids: list[int]) -> bool:
        """Append the tokens of `token_ids` (a sequence's output so far) not fed yet; on a stop
        string, cut `token_ids` after the token that completed it and return True."""
        while (n := len(self.token_ids)) < len(token_ids):  # n: tokens already fed
            if self.append(token_ids[n]):
                del token_ids[n + 1 :]
                return True
        return False

    def _step(self, token_id: int) -> str | None:
        """The new text once token_id completes some, else None."""
        if self._stream is not None:
            try:
                return self._stream.step(self.tokenizer, token_id)
            except Exception:  # a decoder whose output is not prefix-stable: decode by hand
                log.warning("incremental decode failed; decoding this sequence by hand", exc_info=True)
                self._stream = None
        return self._by_hand(final=False)

    def _by_hand(self, final: bool) -> str | None:
        """The text of token_ids[_read:], decoded in the window from _prefix (a token's text may
        depend on the ones before it); None while it ends inside a multi-byte character, unless final."""
        window = self._decode(self.token_ids[self._prefix :])
        if window.endswith("\ufffd") and not final:
            return None
        return window[len(self._decode(self.token_ids[self._prefix : self._read])) :]

    def take(self, final: bool) -> str:
        """Text released since the last call; everything left when `final`."""
        if final and not self.stopped and self._read < len(self.token_ids):
            self.unsent += self._by_hand(final=True) or ""
            self._read = len(self.token_ids)
        if final or self.stopped or not self.holdback:
            out, self.unsent = self.unsent, ""
            return out
        end = max(0, len(self.unsent) - self.holdback)
        out, self.unsent = self.unsent[:end], self.unsent[end:]
        return out


class NoText:
    """The text stream of a sequence whose text is made elsewhere (`SamplingParams.detokenize`
    False): no text, and no stop strings to find in it."""

    stopped = False

    def feed(self, token_ids: list[int]) -> bool:
        return False

    def take(self, final: bool) -> str:
        return ""


NO_TEXT = NoText()
