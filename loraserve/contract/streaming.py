"""What a GenerateStream request may ask of its stream, on both sides of the wire."""

from __future__ import annotations

# GenerateRequest.stream_interval: 0 (the worker's --stream-interval) to this many tokens a message
MAX_STREAM_INTERVAL = 1024


def message_ends(num_tokens: int, stream_interval: int) -> list[int]:
    """How a streamed completion of `num_tokens` that ends at its length or a stop string leaves
    the worker (engine._process_text), as the tokens sent once each message has gone: the first
    token alone, then `stream_interval` (0 counts as 1) a message, what is left with the last;
    1 + ceil((num_tokens - 1) / k) messages. Outputs that queued may still merge on the way."""
    return [*range(1, num_tokens, stream_interval or 1), num_tokens]
