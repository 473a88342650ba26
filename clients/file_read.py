"""Reading a whole file of known size into a buffer, in pieces read at once.

A hand-over file (clients/adapter_download.py) is tens of MB in the page cache of a tmpfs; one
`read` of it is one kernel copy on one core (on an H200 host's CPU ~2.5 GB/s: ~9 ms for the 22.5 MB
of a 1B rank-16 adapter). Pieces of at least PIECE_BYTES are read by `os.preadv` on a small shared
pool of threads (the calling thread reads the first piece itself): each read runs without the
interpreter lock, so the pieces' copies run on as many cores as threads.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

PIECE_BYTES = 4 << 20  # below this a piece's hand-off costs about what its copy saves
READ_THREADS = 4  # pool threads, shared by every read of the process

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="file-read")
        return _pool


def _read_piece(fd: int, view: memoryview, start: int, end: int) -> int:
    """Bytes [start, end) of the file into view[start:end]; -> how many came (fewer at its end)."""
    done = start
    while done < end:
        n = os.preadv(fd, [view[done:end]], done)
        if n <= 0:
            break
        done += n
    return done - start


def read_into(fd: int, view: memoryview, total: int) -> int:
    """The first `total` bytes of the open file `fd` into view[:total]; -> the bytes read (fewer
    when the file is shorter). Raises OSError as os.preadv does."""
    if total <= 0:
        return 0
    pieces = max(1, min(READ_THREADS + 1, total // PIECE_BYTES))
    step = -(-total // pieces)
    bounds = [(s, min(s + step, total)) for s in range(0, total, step)]
    others = [_threads().submit(_read_piece, fd, view, s, e) for s, e in bounds[1:]]
    try:
        got = _read_piece(fd, view, *bounds[0])
    finally:  # every piece ends before the caller may close fd or reuse the buffer
        concurrent.futures.wait(others)
    for future in others:
        got += future.result()  # re-raises a piece's OSError
    return got
