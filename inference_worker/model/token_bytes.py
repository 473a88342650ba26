"""The exact bytes of single tokens, for log-probability answers (`token`, `token_bytes`).

A byte-level BPE vocabulary (GPT-2, Llama 3, SmolLM2) spells each byte as one printable character;
a SentencePiece-style one (Llama 2, Mistral) writes spaces as U+2581 and bytes it has no piece for
as `<0xHH>`; added tokens are their own text. A token may end inside a multi-byte character, so its
text is its bytes decoded with replacement characters, and the bytes are what a client joins.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable character -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_types(decoder: dict | None) -> set[str]:
    if not decoder:
        return set()
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    return {str(d.get("type")) for d in parts}


class TokenBytes:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        types = _decoder_types(json.loads(tokenizer.to_str()).get("decoder"))
        self._byte_level = _byte_level_alphabet() if "ByteLevel" in types else None
        self._sentencepiece = "ByteFallback" in types or "Replace" in types or "Metaspace" in types
        self._added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        """-> (text, bytes) of one token."""
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return hit

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level is not None:
            alphabet = self._byte_level
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        if self._sentencepiece:
            m = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
