"""Client side of AdapterStore.FetchAdapter: rebuild an optimized adapter from its stream.

The stream is one manifest then data chunks covering [offset, total_bytes). Chunks are written
straight into one uint8 buffer (pinned when CUDA is available, so the worker can copy it to the
GPU asynchronously; or a buffer the caller preallocated and reuses); the tensors are views into
that buffer. Given a channel rather than a stub, chunks are decoded by loraserve/contract/chunk_codec.py and
copied once, from the received message into the buffer. A stream that breaks is
resumed from the bytes already received (the request carries the manifest's digest, so a
re-registered adapter cannot be spliced in); one that the store ends with DATA_LOSS and the
REFETCH_KEY trailer (it had streamed bytes of a damaged copy) starts again from offset 0. The
sha256 of the buffer must equal the manifest's digest, else DataLossError.

On the store's host a fetch given `handover_dir` (the directory the store was started with as its
`--handover-dir`, as this process sees it) asks for the payload as a file there: the store answers
with the manifest alone, naming the file, and the payload is read from it into the buffer. That is
a copy between processes of one machine of a payload whose digest the store has checked, not a
transfer, so it is not hashed again (adapter_store/handover.py). A file that is not there (this
process is on another host, or the file was removed meanwhile) or not the payload's size is
skipped: the fetch asks again for a stream at once.

    with grpc.insecure_channel(addr) as ch:
        adapter = fetch_adapter(ch, "my-adapter")   # or a store_pb2_grpc.AdapterStoreStub(ch)
        a = adapter.tensors["layers.0.qkv.lora_a"]   # [3, r, hidden]
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from loraserve.clients.adapter_download import AdapterDownload, DataLossError, FetchedAdapter, FetchError
from loraserve.contract.chunk_codec import REFETCH_KEY
from loraserve.v1 import store_pb2

if TYPE_CHECKING:  # torch is imported where a tensor is made: a download into numpy needs none
    import torch

# A broken stream ends with one of these; anything else (NOT_FOUND, ...) is the server's answer.
FETCH_METHOD = "/loraserve.v1.AdapterStore/FetchAdapter"
RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
)


def _retryable(exc: grpc.RpcError) -> bool:
    code = exc.code() if hasattr(exc, "code") else None
    return code in RETRYABLE


def _refetch(exc: grpc.RpcError) -> bool:
    """The store ended the stream because what it had sent was bad: fetch again from offset 0."""
    if not hasattr(exc, "code") or exc.code() != grpc.StatusCode.DATA_LOSS:
        return False
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return any(k == REFETCH_KEY for k, _ in trailers or ())


def _untraced(exc: grpc.RpcError) -> grpc.RpcError:
    """A failed attempt's error without the frames it was raised through. A sync stream raises its
    call object itself, from one of the call's methods: that frame holds the call, and the call
    (the error) the frame, a reference cycle; and a final error is raised on from the fetch's own
    frames, which hold the download and its buffer. Each cycle would keep the lot for the garbage
    collector instead of letting it go with the error."""
    return exc.with_traceback(None)


def _backoff(attempt: int) -> float:
    """Seconds before resume attempt `attempt` (1, 2, ...): 50 ms doubling, at most 2 s."""
    return min(0.05 * 2 ** (attempt - 1), 2.0)


def _stream(target: Any) -> tuple[Any, bool]:
    """(FetchAdapter callable, raw?) for a channel (raw bytes, decoded here) or a generated stub."""
    if isinstance(target, (grpc.Channel, grpc.aio.Channel)):
        return target.unary_stream(
            FETCH_METHOD,
            request_serializer=store_pb2.FetchAdapterRequest.SerializeToString,
            response_deserializer=None,
        ), True
    return target.FetchAdapter, False


class _Resumable:
    """The protocol both fetch functions follow, apart from their I/O: which request to send next,
    and after each streaming attempt whether the adapter is done, the attempt is retried (after
    `delay` seconds, resuming at the bytes received), or the fetch fails."""

    def __init__(
        self,
        target: Any,
        d: AdapterDownload,
        digest: str,
        max_retries: int,
        timeout: float | None,
        metadata: Sequence[tuple[str, str]] | None,
    ) -> None:
        self._call, raw = _stream(target)
        self.handle = d.on_raw if raw else d.on_message
        self.download, self.digest, self.max_retries = d, digest, max_retries
        self._timeout, self._metadata = timeout, metadata
        self.attempts = 0
        self.retry_now = False  # the next attempt follows without a delay

    def stream(self) -> Any:
        """The next attempt's response stream (sync or async, as the target), from the bytes received."""
        return self._call(self.download.request(self.digest), timeout=self._timeout, metadata=self._metadata)

    def after_attempt(self, exc: grpc.RpcError | None) -> FetchedAdapter | None:
        """The adapter when complete; None to retry after `delay`. Re-raises a final RpcError;
        DataLossError when the bytes do not match the digest and no attempt is left; FetchError
        once retries are spent (the fetch loops end the download's sink threads on any raise)."""
        try:
            d = self.download
            if exc is None and d.handover_missed and not d.complete:
                d.handover_missed = False  # the file could not be read: stream it now, no attempt spent
                self.retry_now = True
                return None
            self.retry_now = False
            spent = self.attempts >= self.max_retries
            refetch = exc is not None and _refetch(exc)
            if exc is not None and not (refetch or _retryable(exc)):
                raise exc
            if refetch:  # the store found its copy damaged: what came is dropped
                if spent:
                    raise exc  # type: ignore[misc]  # refetch implies exc
                d.restart()
            elif d.complete:
                try:
                    return d.finish()
                except DataLossError:
                    # Every byte came, but the stream was cut before its status: the store may not
                    # have finished checking its copy. With attempts left, fetch again from 0.
                    if exc is None or spent:
                        raise
                    d.restart()
            elif exc is not None and spent:
                raise exc
            self.attempts += 1
            if self.attempts > self.max_retries:
                raise FetchError(
                    f"stream of {d.adapter_id!r} ended at byte {d.received} after {self.attempts} attempts"
                )
            return None
        finally:
            exc = None  # raised on: the error must not hold this frame, which holds the error

    @property
    def delay(self) -> float:
        return 0.0 if self.retry_now else _backoff(self.attempts)


def fetch_adapter(
    target,
    adapter_id: str,
    *,
    digest: str = "",
    download: AdapterDownload | None = None,
    max_retries: int = 3,
    timeout: float | None = None,
    metadata: Sequence[tuple[str, str]] | None = None,
    pin_memory: bool | None = None,
    buffer: torch.Tensor | None = None,
    allocate: Callable[[int], np.ndarray] | None = None,
    handover_dir: str | os.PathLike[str] | None = None,
) -> FetchedAdapter:
    """Fetch through a sync channel (fastest) or `AdapterStoreStub`; resumes a broken stream up to
    max_retries times. digest: expected digest (FAILED_PRECONDITION from the store when it differs).
    allocate: given the payload's size, the buffer to fill; handover_dir: the store's hand-over
    directory on this host (see AdapterDownload)."""
    d = download or AdapterDownload(
        adapter_id, pin_memory=pin_memory, buffer=buffer, allocate=allocate, handover_dir=handover_dir
    )
    run = _Resumable(target, d, digest, max_retries, timeout, metadata)
    try:
        while True:
            error: grpc.RpcError | None = None
            try:
                if not d.complete:
                    for msg in run.stream():
                        run.handle(msg)
            except grpc.RpcError as exc:
                error = _untraced(exc)
            try:
                fetched = run.after_attempt(error)
            finally:
                error = None  # (as in after_attempt)
            if fetched is not None:
                return fetched
            time.sleep(run.delay)
    except BaseException:  # failed, a broken contract, no room, interrupted: the sink's threads end now
        d.pause()
        raise


async def fetch_adapter_async(
    target,
    adapter_id: str,
    *,
    digest: str = "",
    download: AdapterDownload | None = None,
    max_retries: int = 3,
    timeout: float | None = None,
    metadata: Sequence[tuple[str, str]] | None = None,
    pin_memory: bool | None = None,
    buffer: torch.Tensor | None = None,
    handover_dir: str | os.PathLike[str] | None = None,
) -> FetchedAdapter:
    """Fetch through a grpc.aio channel (fastest) or an asyncio `AdapterStoreStub`."""
    d = download or AdapterDownload(
        adapter_id, pin_memory=pin_memory, buffer=buffer, handover_dir=handover_dir
    )
    run = _Resumable(target, d, digest, max_retries, timeout, metadata)
    try:
        while True:
            error: grpc.RpcError | None = None
            try:
                if not d.complete:
                    async for msg in run.stream():
                        run.handle(msg)
            except grpc.RpcError as exc:
                error = _untraced(exc)
            try:
                fetched = run.after_attempt(error)
            finally:
                error = None  # (as in after_attempt)
            if fetched is not None:
                return fetched
            await asyncio.sleep(run.delay)
    except BaseException:  # failed, a broken contract, no room, cancelled: the sink's threads end now
        d.pause()
        raise
