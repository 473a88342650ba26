"""Frames between the worker and its front process: a 4-byte big-endian length, then a pickled
list of operations. Both ends are this package's own processes on one host, over a socket in a
directory only the worker's user can enter.

front -> worker: ("call", key, method, request bytes, seconds left or None, metadata pairs, peer,
                  whether the front makes the stream's text)
                 ("cancel", key)
worker -> front: ("tokenizer", -1, tokenizer JSON)  first on each connection (front_text.py)
                 ("message", key, bytes)  a streamed response message
                 ("delta", key, deltas.Delta)  one the front builds (a running output's fields)
                 ("end", key, bytes | None)  the call ended OK (a unary call's response)
                 ("error", key, status code name, details)
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

HEADER = struct.Struct(">I")
MAX_FRAME = 256 << 20


async def read_frame(reader: asyncio.StreamReader) -> list[tuple[Any, ...]] | None:
    """The next frame's operations; None at the end of the stream. ConnectionError for a frame
    that is not one (the caller closes the connection)."""
    try:
        (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        if size > MAX_FRAME:
            raise ValueError(f"a relay frame of {size} bytes")
        ops: list[tuple[Any, ...]] = pickle.loads(await reader.readexactly(size))
        return ops
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError) as exc:  # not our peer's frames
        raise ConnectionError(f"a malformed relay frame: {exc}") from None


def encode_frame(ops: list[tuple[Any, ...]]) -> bytes:
    body = pickle.dumps(ops, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


class FrameWriter:
    """Operations added during one turn of the event loop go out together, as one frame."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._ops: list[tuple[Any, ...]] = []
        self._scheduled = False

    def add(self, op: tuple[Any, ...]) -> None:
        self._ops.append(op)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        ops, self._ops = self._ops, []
        if ops and not self.writer.is_closing():
            self.writer.write(encode_frame(ops))

    async def flush_and_close(self) -> None:
        """Write what was added, wait until the socket took it, and close (the peer reads the end)."""
        self._flush()
        if not self.writer.is_closing():
            await self.writer.drain()
            self.writer.close()
        await self.writer.wait_closed()
