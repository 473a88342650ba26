"""Where a download's chunks go: each copied into its place in the buffer and hashed, in arrival
order, on a thread beside the one that receives them (clients/adapter_fetch.py)."""

from __future__ import annotations

import hashlib
import queue
import threading

import numpy as np


class ChunkSink:
    """Copies each chunk into its place in the buffer and hashes it, in arrival order, on a thread
    of its own: numpy's copy and hashlib let go of the interpreter lock, so both run beside the
    thread that receives the next chunks (a fetch's hash alone is ~15 ms for 22 MB). The thread
    ends when drained, or after IDLE_S with nothing to do (a download left unfinished)."""

    IDLE_S = 5.0

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._queue: queue.SimpleQueue[tuple[np.ndarray, bytes | memoryview] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def put(self, dest: np.ndarray, data: bytes | memoryview) -> None:
        with self._lock:
            self._queue.put((dest, data))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="adapter-fetch-copy", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            if item is None:
                return
            dest, data = item
            dest[:] = np.frombuffer(data, dtype=np.uint8)
            self._sha.update(data)

    def drain(self) -> None:
        """Wait until everything put so far is copied and hashed; the thread ends."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join()

    def hexdigest(self) -> str:
        self.drain()
        return self._sha.hexdigest()
