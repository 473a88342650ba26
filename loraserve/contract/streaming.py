"""What a GenerateStream request may ask of its stream, on both sides of the wire."""

from __future__ import annotations

# GenerateRequest.stream_interval: 0 (the worker's --stream-interval) to this many tokens a message
MAX_STREAM_INTERVAL = 1024
