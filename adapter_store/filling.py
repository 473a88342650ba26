"""A payload that is still being read into memory, followed by the fetches that stream it.

A CPU cache miss served from the disk tier opens the payload's file (header checked), then reads
the payload on a worker thread (hashing it on another, beside the reads) while the fetches that
asked for it already stream its first bytes: a fetch's time becomes the longer of the read and the stream rather than their sum.
A fetch's stream ends (status OK) only once the whole payload has been read and its digest
checked; the last chunk itself goes out as soon as it is read, so the client copies and hashes it
while the store's hash finishes. A client uses the bytes only once its own sha256 of them matches
the digest, and a stream cut between its last chunk and its status whose bytes do not match is
fetched again from offset 0 (clients/adapter_fetch.py). A bad read fails the fetches that follow
it (the servicer tells their clients to fetch again from the start, whatever they had received).
"""

from __future__ import annotations

import asyncio


class Filling:
    """Bytes [0, filled) of a payload of `total` bytes are in memory; `checked` once all of them
    are and their digest matched; `error` when the read failed. Created, waited on and finished on
    the event loop; `advance` may be called from the reading thread, which also appends to `chunks`
    the serialized FetchAdapter chunk message of each `step` bytes it reads, before it advances."""

    def __init__(self, total: int, step: int) -> None:
        self.total, self.step = total, step
        self.chunks: list[bytes] = []
        self.filled = 0
        self.checked = False
        self.error: BaseException | None = None
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()

    # -- the reader's side -------------------------------------------------------------------
    def advance(self, filled: int) -> None:
        """From the reading thread: bytes [0, filled) are in memory."""
        try:
            self._loop.call_soon_threadsafe(self._set, filled)
        except RuntimeError:
            pass  # the loop is closed: the store is gone, and nobody waits any more

    def finish(self, error: BaseException | None = None) -> None:
        """On the loop: the read ended, checked (error None) or failed."""
        if error is None:
            self.filled, self.checked = self.total, True
        else:
            self.error = error
        self._wake()

    def _set(self, filled: int) -> None:
        if filled > self.filled and not self.checked:
            self.filled = filled
            self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # -- a fetch's side ----------------------------------------------------------------------
    def chunk(self, offset: int, end: int) -> bytes | None:
        """The reader's message of bytes [offset, end), once they are in memory; None when it made
        none for that range (a stream resumed off the steps' boundaries)."""
        i, extra = divmod(offset, self.step)
        if extra or end != min(offset + self.step, self.total) or i >= len(self.chunks):
            return None
        return self.chunks[i]

    async def wait(self, upto: int) -> None:
        """Until bytes [0, upto) may be sent: in memory (upto <= total: once checked, all `total`
        are). Raises the read's error once it has failed."""
        while True:
            if self.error is not None:
                raise self.error
            if self.filled >= upto:
                return
            await self._changed.wait()

    async def verified(self) -> None:
        """Until the whole payload is read and its digest checked (a stream may end). Raises the
        read's error once it has failed."""
        while True:
            if self.error is not None:
                raise self.error
            if self.checked:
                return
            await self._changed.wait()
