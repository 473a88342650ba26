"""One optimized payload as a file of the store's disk tier: its manifest and its bytes, written
atomically and read back with every byte checked.

File layout (all integers little-endian):

    magic      8 bytes   b"LSPAYLD1"
    header_len 8 bytes   length of the JSON header
    header_sha 32 bytes  sha256 of the JSON header
    header     JSON      adapter_id, digest, rank, dtype, layout_version, total_bytes, tensors
                         ([name, shape, dtype, offset, nbytes] each)
    padding    zeros up to a multiple of 64 bytes
    payload    total_bytes, whose sha256 is `digest`

The header's own sha256 catches a damaged manifest; the digest catches a damaged payload, and is
computed while the bytes are read, so a file is never trusted before it has been checked in full.
The name is `{adapter_id}@{digest}.payload` (`@` is outside the adapter id alphabet), so a file of
another version of an adapter can never be mistaken for the current one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import queue
import re
import struct
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from loraserve.adapter_store.optimize import OptimizedAdapter
from loraserve.contract.adapter_layout import ADAPTER_ID_RE, ALIGN, align
from loraserve.contract.chunk_codec import encode_chunk
from loraserve.contract.payload import TORCH_DTYPES, PayloadTensor

MAGIC = b"LSPAYLD1"
SUFFIX = ".payload"
TEMP_PREFIX = ".tmp-"  # a write in progress (or one a crash left behind)
_PREAMBLE = struct.Struct("<8sQ32s")  # magic, header length, header sha256
MAX_HEADER_BYTES = 16 << 20
READ_STEP = 1 << 20  # bytes per read, hash update and chunk message (a fetch streams what is read so far)
NAME_RE = re.compile(f"({ADAPTER_ID_RE.pattern})@([0-9a-f]{{64}}){re.escape(SUFFIX)}")


class CorruptPayload(Exception):
    """A payload file that does not hold what its name and header promise."""


@dataclass(frozen=True)
class PayloadKey:
    adapter_id: str
    digest: str

    @property
    def file_name(self) -> str:
        return f"{self.adapter_id}@{self.digest}{SUFFIX}"

    @classmethod
    def from_file_name(cls, name: str) -> PayloadKey | None:
        """The key a file of the tier is named for; None for any other name."""
        m = NAME_RE.fullmatch(name)
        return cls(m.group(1), m.group(2)) if m else None


def _header(key: PayloadKey, adapter: OptimizedAdapter) -> bytes:
    return json.dumps(
        {
            "adapter_id": key.adapter_id,
            "digest": adapter.digest,
            "rank": adapter.rank,
            "dtype": adapter.dtype,
            "layout_version": adapter.layout_version,
            "total_bytes": adapter.total_bytes,
            "tensors": [[t.name, list(t.shape), t.dtype, t.offset, t.nbytes] for t in adapter.tensors],
        },
        separators=(",", ":"),
    ).encode()


def write_payload(directory: Path, key: PayloadKey, adapter: OptimizedAdapter) -> int:
    """Write the file of `adapter` under `directory` (temp file, fsync, rename, fsync of the
    directory); -> its size in bytes. Raises OSError; a failed write leaves no file behind."""
    header = _header(key, adapter)
    start = align(_PREAMBLE.size + len(header))
    preamble = _PREAMBLE.pack(MAGIC, len(header), hashlib.sha256(header).digest())
    temp = directory / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
    try:
        with open(temp, "wb") as f:
            f.write(preamble + header + bytes(start - _PREAMBLE.size - len(header)))
            f.write(memoryview(adapter.payload.numpy()))  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, directory / key.file_name)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    sync_directory(directory)
    return start + adapter.total_bytes


def sync_directory(directory: Path) -> None:
    """Make renames and unlinks in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_up_to(f: BinaryIO, n: int) -> bytes:
    """Up to `n` bytes as one bytes object, fewer only at the end of the file."""
    data = f.read(n)
    while data and len(data) < n:  # a short read before the end (a signal): read the rest
        more = f.read(n - len(data))
        if not more:
            break
        data += more
    return data


def _read_exact(f: BinaryIO, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CorruptPayload(f"truncated: {what} is {len(data)} of {n} bytes")
    return data


def _tensors(header: dict, total: int) -> list[PayloadTensor]:
    tensors = []
    for name, shape, dtype, offset, nbytes in header["tensors"]:
        if dtype not in TORCH_DTYPES or offset % ALIGN or not 0 <= offset <= offset + nbytes <= total:
            raise CorruptPayload(f"tensor {name} ({dtype}, {nbytes} bytes at {offset}) is out of place")
        tensors.append(
            PayloadTensor(str(name), tuple(int(s) for s in shape), dtype, int(offset), int(nbytes))
        )
    return tensors


class PayloadReader:
    """A payload file whose header has been checked (`open_payload`): `adapter` names its tensors and
    holds the buffer that `read` fills, in order, so that the first bytes can be used (streamed)
    while the rest are read. Nothing in `adapter.payload` is to be trusted until `read` returns."""

    def __init__(self, f: io.FileIO, key: PayloadKey, adapter: OptimizedAdapter) -> None:
        self._f, self.key, self.adapter = f, key, adapter

    @property
    def total_bytes(self) -> int:
        return self.adapter.total_bytes

    def read(
        self,
        progress: Callable[[int], None] | None = None,
        chunks: list[bytes] | None = None,
        step: int | None = None,
    ) -> OptimizedAdapter:
        """Read and hash the payload, `step` bytes at a time (default READ_STEP); `progress(bytes
        read so far)` after each step (the bytes are in memory, not yet checked). With `chunks`,
        each step's bytes are also appended to it, before its `progress`, as the serialized
        FetchAdapter chunk message of their range (`chunk_codec.encode_chunk`): made here, beside
        the fetches' event loop, which then sends them as they are. Every copy lets go of the
        interpreter lock (the read into a bytes object, numpy's copy into the buffer, bytes.join of
        bytes, the hash on a thread beside the reads), so reading does not hold up the fetches'
        event loop. CorruptPayload when the payload is short or its sha256 is not the key's digest,
        OSError when it cannot be read. The file is closed either way."""
        total, step = self.adapter.total_bytes, step or READ_STEP
        array = self.adapter.payload.numpy()
        sha = hashlib.sha256()
        pieces: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

        def hash_pieces() -> None:  # hashlib lets go of the interpreter lock on large updates
            while (piece := pieces.get()) is not None:
                sha.update(piece)

        hasher = threading.Thread(target=hash_pieces, name="payload-hash", daemon=True)
        hasher.start()
        done = 0
        try:
            with self._f as f:
                while done < total:
                    data = _read_up_to(f, min(step, total - done))
                    if not data:
                        raise CorruptPayload(f"truncated: the payload is {done} of {total} bytes")
                    n = len(data)
                    array[done : done + n] = np.frombuffer(data, dtype=np.uint8)
                    pieces.put(data)
                    if chunks is not None:
                        chunks.append(encode_chunk(done, data))
                    done += n
                    if progress is not None:
                        progress(done)
        finally:
            pieces.put(None)
            hasher.join()
        if sha.hexdigest() != self.key.digest:
            raise CorruptPayload(f"the payload's sha256 is {sha.hexdigest()}, not {self.key.digest}")
        return self.adapter

    def close(self) -> None:
        self._f.close()


def open_payload(path: Path, key: PayloadKey, expected_bytes: int) -> PayloadReader:
    """Open the file at `path` for `key` (key.digest is the registry's) and check what can be checked
    before the payload: header sha256, header fields against the key and `expected_bytes`, the
    file's exact length. CorruptPayload when a check fails, OSError when the file cannot be read."""
    f = open(path, "rb", buffering=0)  # the reader closes it
    try:
        magic, header_len, header_sha = _PREAMBLE.unpack(_read_exact(f, _PREAMBLE.size, "the preamble"))
        if magic != MAGIC or header_len > MAX_HEADER_BYTES:
            raise CorruptPayload(f"not a payload file (magic {magic!r}, header of {header_len} bytes)")
        raw = _read_exact(f, header_len, "the header")
        if hashlib.sha256(raw).digest() != header_sha:
            raise CorruptPayload("the header does not match its sha256")
        try:
            header = json.loads(raw)
            total = int(header["total_bytes"])
            named = (header["adapter_id"], header["digest"])
            tensors = _tensors(header, total)
            rank, dtype, layout_version = (
                int(header["rank"]),
                str(header["dtype"]),
                int(header["layout_version"]),
            )
        except (ValueError, KeyError, TypeError) as exc:  # a header this module did not write
            raise CorruptPayload(f"malformed header: {exc!r}") from None
        if named != (key.adapter_id, key.digest) or total != expected_bytes:
            raise CorruptPayload(
                f"the header names {named[0]}@{named[1]} of {total} bytes, "
                f"not {key.adapter_id}@{key.digest} of {expected_bytes} bytes"
            )
        start = align(_PREAMBLE.size + header_len)
        if os.fstat(f.fileno()).st_size != start + total:
            raise CorruptPayload(f"the file is {os.fstat(f.fileno()).st_size} bytes, not {start + total}")
        f.seek(start)
        payload = torch.empty(total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    except BaseException:
        f.close()
        raise
    return PayloadReader(f, key, OptimizedAdapter(tensors, payload, key.digest, rank, dtype, layout_version))
