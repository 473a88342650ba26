"""clients/file_read.py: a file read into a buffer in pieces on several threads lands byte for
byte where one sequential read would put it; a short file reports what it had."""

from __future__ import annotations

import os

import numpy as np
import pytest

from loraserve.clients import file_read
from loraserve.clients.file_read import PIECE_BYTES, read_into


def _file(tmp_path, data: bytes):
    path = tmp_path / "payload"
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY)


@pytest.mark.parametrize(
    "size",
    [0, 1, PIECE_BYTES - 1, PIECE_BYTES, 2 * PIECE_BYTES + 7, 5 * PIECE_BYTES + 3, 9 * PIECE_BYTES + 1],
)
def test_pieces_land_in_place(tmp_path, size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    fd = _file(tmp_path, data)
    out = np.full(size + 16, 0xAB, dtype=np.uint8)  # bytes past `total` stay untouched
    try:
        assert read_into(fd, memoryview(out), size) == size
    finally:
        os.close(fd)
    assert out[:size].tobytes() == data
    assert (out[size:] == 0xAB).all()


def test_a_short_file_reads_what_it_has(tmp_path):
    size = 3 * PIECE_BYTES
    data = os.urandom(size - PIECE_BYTES // 2)
    fd = _file(tmp_path, data)
    out = np.zeros(size, dtype=np.uint8)
    try:
        assert read_into(fd, memoryview(out), size) == len(data)
    finally:
        os.close(fd)
    assert out[: len(data)].tobytes() == data


def test_several_pieces_use_the_pool(tmp_path, monkeypatch):
    """A payload of several pieces is read by more than the calling thread."""
    import threading

    readers: set[str] = set()
    real = file_read._read_piece

    def counted(fd, view, start, end):
        readers.add(threading.current_thread().name)
        return real(fd, view, start, end)

    monkeypatch.setattr(file_read, "_read_piece", counted)
    size = 4 * PIECE_BYTES
    fd = _file(tmp_path, os.urandom(size))
    try:
        assert read_into(fd, memoryview(np.empty(size, dtype=np.uint8)), size) == size
    finally:
        os.close(fd)
    assert threading.current_thread().name in readers
    assert any(name.startswith("file-read") for name in readers)


def test_a_failed_read_raises_after_every_piece_ended(tmp_path):
    size = 3 * PIECE_BYTES
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: every piece's read fails
    try:
        with pytest.raises(IsADirectoryError):
            read_into(fd, memoryview(np.empty(size, dtype=np.uint8)), size)
    finally:
        os.close(fd)
