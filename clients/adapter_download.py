"""One download of an adapter's payload (clients/adapter_fetch.py drives it through FetchAdapter
calls): the manifest checked, the buffer made or given, chunks copied and hashed in order, or the
payload read from the store's hand-over file on this host (not hashed again: see
clients/adapter_fetch.py); `finish` checks the digest and makes the tensor views."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from loraserve.clients.chunk_sink import ChunkSink, ChunkSinkError
from loraserve.clients.file_read import read_into
from loraserve.contract.adapter_layout import DIGEST_RE, DTYPES, ITEMSIZES, LAYOUT_VERSION
from loraserve.contract.chunk_codec import decode_response
from loraserve.v1 import store_pb2

if TYPE_CHECKING:  # torch is imported where a tensor is made: a download into numpy needs none
    import torch


class FetchError(Exception):
    """The stream violated the FetchAdapter contract (or could not be completed)."""


class DataLossError(FetchError):
    """The rebuilt payload does not hash to the manifest's digest."""


@dataclass
class FetchedAdapter:
    manifest: store_pb2.AdapterManifest
    buffer: torch.Tensor | None  # [total_bytes] uint8 (None for a download into a numpy array)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # views into buffer
    # "file": the payload was handed over as a file; "missed": the store named a file that this
    # process could not read (so it was streamed: is the hand-over directory really shared?);
    # "": streamed
    handover: str = ""

    @property
    def adapter_id(self) -> str:
        return self.manifest.adapter.adapter_id

    @property
    def digest(self) -> str:
        return self.manifest.digest

    @property
    def rank(self) -> int:
        return self.manifest.rank


class AdapterDownload:
    """State of one download; keep it to resume later with `fetch_adapter(..., download=d)`."""

    def __init__(
        self,
        adapter_id: str,
        *,
        pin_memory: bool | None = None,
        buffer: torch.Tensor | None = None,
        allocate: Callable[[int], np.ndarray] | None = None,
        handover_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        """buffer: an optional preallocated 1-D uint8 tensor to fill (its first total_bytes are used);
        allocate: instead, a function that returns a writable 1-D uint8 numpy array for the
        manifest's total_bytes (called once): the download then makes no tensor (nor imports torch),
        and `finish` checks the digest only; handover_dir: the store's hand-over directory as seen
        here (see the module's docstring)."""
        self.adapter_id = adapter_id
        self.manifest: store_pb2.AdapterManifest | None = None
        self._given = buffer
        self._allocate = allocate
        self.buffer: torch.Tensor | None = None
        self.received = 0  # bytes [0, received) are in buffer
        self._np: np.ndarray | None = None
        self._sink = ChunkSink()  # copies and hashes [0, received) in order, beside the receiving
        self._pin = pin_memory  # None: pinned where CUDA is available
        self._handover_dir = Path(handover_dir) if handover_dir else None
        self.handover = ""  # as FetchedAdapter.handover
        self.handover_missed = False  # the last attempt's file could not be read: stream at once

    @property
    def asks_handover(self) -> bool:
        return self._handover_dir is not None and not self.handover and self.received == 0

    def request(self, digest: str = "") -> store_pb2.FetchAdapterRequest:
        want = self.manifest.digest if self.manifest is not None else digest
        return store_pb2.FetchAdapterRequest(
            adapter_id=self.adapter_id, offset=self.received, digest=want, handover=self.asks_handover
        )

    @property
    def complete(self) -> bool:
        return self.manifest is not None and self.received == self.manifest.total_bytes

    def on_message(self, msg: store_pb2.FetchAdapterResponse) -> None:
        kind = msg.WhichOneof("payload")
        if kind == "manifest":
            self._on_manifest(msg.manifest)
        elif kind == "chunk":
            self._write(msg.chunk.offset, msg.chunk.data)
        else:
            raise FetchError("FetchAdapter message carries neither manifest nor chunk")

    def on_raw(self, raw: bytes) -> None:
        """One serialized FetchAdapterResponse (the channel path)."""
        try:
            decoded = decode_response(raw)
        except ValueError as exc:
            raise FetchError(f"malformed FetchAdapter message: {exc}") from exc
        if isinstance(decoded, tuple):
            self._write(*decoded)
        else:
            self.on_message(decoded)

    def _on_manifest(self, m: store_pb2.AdapterManifest) -> None:
        if self.manifest is not None:
            if (m.digest, m.total_bytes) != (self.manifest.digest, self.manifest.total_bytes):
                raise FetchError(
                    f"adapter {self.adapter_id!r} changed while resuming "
                    f"(digest {self.manifest.digest} -> {m.digest})"
                )
            if m.handover_file:  # asked again after a restart from offset 0
                self._read_handover(m.handover_file)
            return
        if m.layout_version != LAYOUT_VERSION:
            raise FetchError(
                f"layout version {m.layout_version} is not supported (expected {LAYOUT_VERSION})"
            )
        for t in m.tensors:
            itemsize = ITEMSIZES.get(t.dtype, 0)
            nbytes = int(np.prod(t.shape, dtype=np.int64)) * itemsize
            if (
                t.dtype not in DTYPES
                or t.nbytes != nbytes
                or t.offset < 0
                or t.offset + t.nbytes > m.total_bytes
            ):
                raise FetchError(
                    f"manifest entry {t.name!r} is inconsistent ({t.dtype}, {list(t.shape)}, "
                    f"offset {t.offset}, {t.nbytes} bytes of {m.total_bytes})"
                )
        self.manifest = m
        if self._allocate is not None:
            out = self._allocate(m.total_bytes)
            if out.dtype != np.uint8 or out.ndim != 1 or out.size < m.total_bytes or not out.flags.writeable:
                raise FetchError(
                    f"the allocated array cannot hold {m.total_bytes} bytes (writable 1-D uint8)"
                )
            self._np = out[: m.total_bytes]
        else:
            self._np = self._make_buffer(m)
        if m.handover_file:
            self._read_handover(m.handover_file)

    def _make_buffer(self, m: store_pb2.AdapterManifest) -> np.ndarray:
        """The tensor to fill (`buffer`): the given one, else a new one; -> its numpy view."""
        import torch

        if self._given is not None:
            if (
                self._given.dtype != torch.uint8
                or self._given.dim() != 1
                or self._given.numel() < m.total_bytes
                or self._given.device.type != "cpu"
            ):
                raise FetchError(f"the given buffer cannot hold {m.total_bytes} bytes (1-D CPU uint8 needed)")
            self.buffer = self._given[: m.total_bytes]
        else:
            pin = torch.cuda.is_available() if self._pin is None else self._pin
            self.buffer = torch.empty(m.total_bytes, dtype=torch.uint8, pin_memory=pin)
        return self.buffer.numpy()

    def _read_handover(self, name: str) -> None:
        """The payload from the store's hand-over file `name`, else (missing, or not the payload's
        size) nothing: the download streams it next."""
        assert self.manifest is not None and self._np is not None
        if not self.asks_handover or self._handover_dir is None:  # as the request asked
            raise FetchError(f"adapter {self.adapter_id!r}: the store handed over a file unasked")
        if name != self.manifest.digest or not DIGEST_RE.fullmatch(name):  # a plain file name
            raise FetchError(
                f"adapter {self.adapter_id!r}: hand-over file {name[:80]!r} is not named by its digest"
            )
        total = self.manifest.total_bytes
        done = -1
        try:
            fd = os.open(self._handover_dir / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_size == total:  # read in pieces, at once
                    done = read_into(fd, memoryview(self._np), total)  # type: ignore[arg-type]
            finally:
                os.close(fd)
        except OSError:
            pass  # missed: streamed next
        if done != total:
            self.handover = "missed"
            self.handover_missed = True
            return
        self.received = total
        self.handover = "file"

    def _write(self, offset: int, data: bytes | memoryview) -> None:
        if self.manifest is None or self._np is None:
            raise FetchError("data chunk before the manifest")
        n = len(data)
        if offset != self.received or offset + n > self.manifest.total_bytes:
            raise FetchError(
                f"chunk at offset {offset} (+{n}) does not continue at {self.received} "
                f"within {self.manifest.total_bytes} bytes"
            )
        try:
            self._sink.put(self._np[offset : offset + n], data)
        except ChunkSinkError as exc:
            raise FetchError(f"adapter {self.adapter_id!r}: {exc}") from exc
        self.received += n

    def restart(self) -> None:
        """Forget the bytes received (the store said they came from a damaged copy): the next
        request starts at offset 0; the manifest, and so the expected digest, stay."""
        self.pause()
        self._sink = ChunkSink()
        self.received = 0
        if self.handover == "file":  # a checked file came, yet the store said refetch: stream it
            self.handover = "missed"

    def pause(self) -> None:
        """Let the copying and hashing threads finish what they were given and end (a fetch that
        gave up; a resumed download starts others). A download left otherwise ends them after
        ChunkSink.IDLE_S."""
        with contextlib.suppress(ChunkSinkError):  # given up: whatever the sink held is dropped
            self._sink.drain()

    def finish(self) -> FetchedAdapter:
        """Check the digest and build the tensor views."""
        assert self.manifest is not None and self._np is not None
        try:
            # a hand-over file: checked by the store, copied on this host (see the module's docstring)
            actual = self.manifest.digest if self.handover == "file" else self._sink.hexdigest()
        except ChunkSinkError as exc:
            raise FetchError(f"adapter {self.adapter_id!r}: {exc}") from exc
        if actual != self.manifest.digest:
            raise DataLossError(
                f"adapter {self.adapter_id!r}: payload sha256 {actual} does not match "
                f"the manifest digest {self.manifest.digest}"
            )
        if self.buffer is None:  # downloaded into the caller's numpy array
            return FetchedAdapter(self.manifest, None, handover=self.handover)
        from loraserve.contract.payload import tensor_view

        tensors = {t.name: tensor_view(self.buffer, t) for t in self.manifest.tensors}
        return FetchedAdapter(self.manifest, self.buffer, tensors, self.handover)
