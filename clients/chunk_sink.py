"""Where a download's chunks go: each copied into its place in the buffer and hashed, in arrival
order, beside the thread that receives them (clients/adapter_fetch.py)."""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")


class ChunkSinkError(RuntimeError):
    """A chunk could not be copied or hashed: what the sink holds is not the download."""


class _Lane(Generic[T]):
    """`work(item)` for each item put, in order, on a thread of its own, started by the first put;
    the thread ends when drained, or after `idle_s` with nothing to do (a download left unfinished).
    One producer: `put` and `drain` are called from one thread at a time. Once a `work` call has
    raised, the rest is skipped and `drain` (and every `put` after) raises ChunkSinkError."""

    def __init__(self, work: Callable[[T], object], name: str, idle_s: float) -> None:
        self._work, self._name, self._idle_s = work, name, idle_s
        self._queue: queue.SimpleQueue[T | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _check(self) -> None:
        if self._error is not None:
            raise ChunkSinkError(f"{self._name}: {self._error!r}") from self._error

    def put(self, item: T) -> None:
        self._check()
        with self._lock:
            self._queue.put(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            if item is None:
                return
            if self._error is None:
                try:
                    self._work(item)
                except BaseException as exc:
                    # kept without its traceback, whose frame (this one) holds the lane holding it
                    self._error = exc.with_traceback(None)

    def drain(self) -> None:
        """Wait until everything put so far is done; the thread ends."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join()
        self._check()


def _copy(item: tuple[np.ndarray, bytes | memoryview]) -> None:
    dest, data = item
    dest[:] = np.frombuffer(data, dtype=np.uint8)


class ChunkSink:
    """Copies each chunk into its place in the buffer on one thread and hashes it on another, in
    arrival order, both beside the thread that receives the next chunks (numpy's copy and hashlib
    let go of the interpreter lock). The hash alone runs about as long as the stream (sha256 of
    22.5 MB: ~15 ms on an H200 host's CPU, the stream ~18 ms): with the copies on the same thread
    it fell behind, and the digest was checked 4-6 ms after the last chunk arrived instead of
    ~1 ms (benchmarks/bench_fetch_breakdown.py). Each thread ends when drained, or after IDLE_S
    with nothing to do."""

    IDLE_S = 5.0

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._hashing: _Lane[bytes | memoryview] = _Lane(self._sha.update, "adapter-fetch-hash", self.IDLE_S)
        self._copying: _Lane[tuple[np.ndarray, bytes | memoryview]] = _Lane(
            _copy, "adapter-fetch-copy", self.IDLE_S
        )

    def put(self, dest: np.ndarray, data: bytes | memoryview) -> None:
        """Copy `data` into `dest` (of its length) and add it to the hash, after what came before."""
        self._hashing.put(data)
        self._copying.put((dest, data))

    def drain(self) -> None:
        """Wait until everything put so far is copied and hashed; the threads end. ChunkSinkError
        when a chunk could not be copied or hashed."""
        try:
            self._hashing.drain()
        finally:
            self._copying.drain()

    def hexdigest(self) -> str:
        self.drain()
        return self._sha.hexdigest()
