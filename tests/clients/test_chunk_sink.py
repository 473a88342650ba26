"""ChunkSink: chunks copied into their places and hashed in arrival order, on threads that end."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from loraserve.clients.chunk_sink import ChunkSink, ChunkSinkError

NAMES = ("adapter-fetch-copy", "adapter-fetch-hash")


def _sink_threads(besides: frozenset[threading.Thread] = frozenset()) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in NAMES and t not in besides]


def test_chunks_land_in_place_and_hash_in_order() -> None:
    payload = os.urandom(300_000)
    dest = np.zeros(len(payload), dtype=np.uint8)
    sink = ChunkSink()
    step = 7_777  # uneven chunks, as bytes and as views into a larger message
    for offset in range(0, len(payload), step):
        piece = payload[offset : offset + step]
        data = memoryview(b"\x12\x00" + piece)[2:] if (offset // step) % 2 else piece
        sink.put(dest[offset : offset + len(piece)], data)
    assert sink.hexdigest() == hashlib.sha256(payload).hexdigest()
    assert dest.tobytes() == payload


def test_a_chunk_out_of_order_changes_the_digest() -> None:
    a, b = os.urandom(1000), os.urandom(1000)
    dest = np.zeros(2000, dtype=np.uint8)
    sink = ChunkSink()
    sink.put(dest[1000:], b)
    sink.put(dest[:1000], a)
    assert sink.hexdigest() == hashlib.sha256(b + a).hexdigest() != hashlib.sha256(a + b).hexdigest()
    assert dest.tobytes() == a + b  # each in its place


def test_threads_end_when_drained() -> None:
    others = frozenset(_sink_threads())
    sink = ChunkSink()
    sink.put(np.zeros(10, dtype=np.uint8), b"0123456789")
    assert _sink_threads(others)
    sink.hexdigest()
    assert not _sink_threads(others)


def test_threads_of_a_sink_left_unfinished_end_when_idle(monkeypatch) -> None:
    monkeypatch.setattr(ChunkSink, "IDLE_S", 0.05)
    others = frozenset(_sink_threads())
    sink = ChunkSink()
    dest = np.zeros(20, dtype=np.uint8)
    sink.put(dest[:10], b"0123456789")
    deadline = time.monotonic() + 5
    while _sink_threads(others):
        assert time.monotonic() < deadline, "the sink's threads did not end"
        time.sleep(0.01)
    sink.put(dest[10:], b"abcdefghij")  # taken up again by new threads
    assert sink.hexdigest() == hashlib.sha256(b"0123456789abcdefghij").hexdigest()
    assert dest.tobytes() == b"0123456789abcdefghij" and not _sink_threads(others)


def test_a_chunk_that_cannot_be_copied_fails_the_sink_not_just_its_thread() -> None:
    """A copy that raises (here: a destination of the wrong size) is not lost with its thread: the
    hash of the bytes alone would still match, so drain, hexdigest and every later put raise."""
    sink = ChunkSink()
    dest = np.zeros(20, dtype=np.uint8)
    sink.put(dest[:5], b"0123456789")  # 10 bytes into 5
    with pytest.raises(ChunkSinkError, match="adapter-fetch-copy"):
        sink.hexdigest()
    with pytest.raises(ChunkSinkError):
        sink.put(dest[10:20], b"abcdefghij")
    with pytest.raises(ChunkSinkError):
        sink.drain()
    assert not dest.any()


def test_a_failed_sink_leaves_no_cycle() -> None:
    """The error a lane keeps does not hold the lane's own frame: a download that failed so goes
    with its last reference, not with a garbage collection."""
    from tests.helpers.saved_garbage import garbage, of_worker, saving_garbage

    with saving_garbage():
        garbage(of_worker)
        sink = ChunkSink()
        sink.put(np.zeros(5, dtype=np.uint8), b"0123456789")  # 10 bytes into 5
        with pytest.raises(ChunkSinkError):
            sink.drain()
        del sink
        assert garbage(of_worker) == []


def test_a_download_whose_chunk_cannot_be_copied_fails(monkeypatch) -> None:
    """Through AdapterDownload: a failed copy ends the fetch with FetchError, never a digest match."""
    from loraserve.clients import adapter_fetch, chunk_sink

    def broken(item) -> None:
        raise OSError("copy failed")

    monkeypatch.setattr(chunk_sink, "_copy", broken)
    payload = os.urandom(4096)
    d = adapter_fetch.AdapterDownload("a", pin_memory=False)
    d.manifest = SimpleNamespace(total_bytes=len(payload), digest=hashlib.sha256(payload).hexdigest())
    d._np = np.zeros(len(payload), dtype=np.uint8)
    d._write(0, payload)
    with pytest.raises(adapter_fetch.FetchError, match="copy failed"):
        d.finish()
