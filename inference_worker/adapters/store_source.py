"""Where the worker gets adapters: the adapter store over gRPC (FetchAdapter stream, digest
checked by clients/adapter_fetch.py). Turns the store's answers into adapter failures.

A fetch runs in the worker's fetch process (inference_worker/fetching) where it can, else on one of a few
fetch threads over a sync channel; never on the worker's event loop: receiving, copying and
hashing tens of MB per adapter there would stall every token stream the loop serves (measured under
serving load at 1,000 adapters: the loop spent a third of its time in fetches). Listings (the
store check's ListAdapters) take the threads and their channel."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from loraserve.clients.channel import KEEPALIVE, Keepalive, bearer_metadata
from loraserve.contract.payload import PayloadTensor
from loraserve.inference_worker.errors import (
    AdapterCorrupt,
    AdapterMismatch,
    AdapterNotFound,
    DependencyUnavailable,
    InvalidRequest,
    WorkerError,
)
from loraserve.inference_worker.lora.payload import AdapterPayload

if TYPE_CHECKING:
    import grpc
    import torch

    from loraserve.inference_worker.fetching.process import FetchFailure, FetchProcess

T = TypeVar("T")
log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    # reconnect quickly once the store is back (the default backoff grows to minutes)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 8 << 20),
    # a fetch's stream may run 8 MiB ahead of its reader instead of gRPC's 64 KiB to start with
    # (H200 host, 22.5 MB: a bare stream of 1 MiB chunks 23 -> 16 ms; a fetch through the fetch
    # process, which also copies and hashes, 35.7-39.8 -> 34.5-36.4 ms)
    ("grpc.http2.lookahead_bytes", 8 << 20),
]


class StoreSource:
    """One sync channel to the store and `max_fetches` fetch threads, made on first use; fetches
    and listings run on the threads. Every channel to the store (this one, the fetch process's)
    sends the clients' keepalive pings: a fetch from a store whose host went away, or whose process
    is stopped, ends UNAVAILABLE within the keepalive's interval and timeout, not at its deadline."""

    def __init__(
        self,
        address: str,
        *,
        token: str = "",
        timeout_s: float = 60.0,
        max_retries: int = 2,
        tls_root_cert: bytes | None = None,
        max_fetches: int = 4,
        fetch_process: bool = False,
        handover_dir: str | None = None,
        keepalive: Keepalive | None = KEEPALIVE,
    ) -> None:
        """fetch_process: fetch in a child process (inference_worker/fetching) where shared memory
        allows; handover_dir: the store's hand-over directory on this host (clients/adapter_fetch.py);
        keepalive: the channels' pings (None: none)."""
        self.address = address
        self.channel_options = [*CHANNEL_OPTIONS, *(keepalive.options() if keepalive is not None else ())]
        self._metadata: Sequence[tuple[str, str]] | None = bearer_metadata(token)
        self._timeout_s, self._max_retries = timeout_s, max_retries
        self._tls_root_cert = tls_root_cert
        self._max_fetches = max_fetches
        self._handover_dir = handover_dir
        self._handover_missed_logged = False
        self._channel: grpc.Channel | None = None
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._process: FetchProcess | None = None
        if fetch_process:
            from loraserve.inference_worker.fetching import process as fp

            if fp.FetchProcess.supported():
                self._process = fp.FetchProcess(
                    address,
                    timeout_s=timeout_s,
                    max_retries=max_retries,
                    tls_root_cert=tls_root_cert,
                    max_fetches=max_fetches,
                    options=self.channel_options,
                    handover_dir=handover_dir,
                )
            else:
                log.info("no shared memory at %s: adapters are fetched in the worker's process", fp.SHM_DIR)

    @property
    def max_fetches(self) -> int:
        """Fetches that run at once (the fetch threads); the adapters' fetcher sends no more."""
        return self._max_fetches

    def start(self) -> None:
        """Start the fetch process now (else the first fetch does)."""
        if self._process is not None:
            self._process.start()

    async def _on_thread(self, call: Callable[[grpc.Channel], T], adapter_id: str = "") -> T:
        """`call(channel)` on a fetch thread; its gRPC errors become adapter failures."""
        import grpc

        from loraserve.clients.channel import open_channel

        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(
                self._max_fetches, thread_name_prefix="adapter-fetch"
            )
        if self._channel is None:
            self._channel = open_channel(
                self.address, root_certificates=self._tls_root_cert, options=self.channel_options
            )
        try:
            return await asyncio.get_running_loop().run_in_executor(self._threads, call, self._channel)
        except grpc.RpcError as exc:
            raise failure_of(exc, adapter_id) from None
        except RuntimeError as exc:  # the fetch threads were shut down: the worker is stopping
            doing = f"fetching adapter {adapter_id!r}" if adapter_id else "listing the store's adapters"
            raise DependencyUnavailable(f"{doing} stopped: {exc}") from None

    async def fetch(self, adapter_id: str, digest: str = "") -> AdapterPayload:
        from loraserve.serving import tracing

        # the fetch sends the trace context of the span this coroutine runs in
        metadata = tracing.inject(self._metadata) if tracing.enabled() else self._metadata
        if self._process is not None:
            from loraserve.inference_worker.fetching import process as fp

            try:
                got = await self._process.fetch(adapter_id, digest, metadata)
            except fp.Unavailable as exc:
                log.warning("adapter %r fetched in-process: %s", adapter_id, exc)
            except fp.ProcessGone as exc:
                raise DependencyUnavailable(f"fetching adapter {adapter_id!r} stopped: {exc}") from None
            except fp.FetchFailure as exc:
                raise _failure_in_process(exc, adapter_id) from None
            else:
                return self._handed_over(
                    TENSOR_TABLES.payload(got.manifest, got.buffer, adapter_id), got.handover
                )
        return await self._fetch_here(adapter_id, digest, metadata)

    async def _fetch_here(
        self, adapter_id: str, digest: str, metadata: Sequence[tuple[str, str]] | None
    ) -> AdapterPayload:
        from loraserve.clients.adapter_fetch import DataLossError, FetchError, fetch_adapter

        run = functools.partial(
            fetch_adapter,  # given the channel itself: chunks are decoded straight into the buffer
            adapter_id=adapter_id,
            digest=digest,
            max_retries=self._max_retries,
            timeout=self._timeout_s,
            metadata=metadata,
            handover_dir=self._handover_dir,
        )
        try:
            fetched = await self._on_thread(run, adapter_id)
        except DataLossError as exc:
            raise AdapterCorrupt(str(exc)) from None
        except FetchError as exc:
            raise DependencyUnavailable(
                f"fetching adapter {adapter_id!r} from the store failed: {exc}"
            ) from None
        assert fetched.buffer is not None  # fetched into a tensor of its own
        payload = TENSOR_TABLES.payload(fetched.manifest.SerializeToString(), fetched.buffer, adapter_id)
        return self._handed_over(payload, fetched.handover)

    def _handed_over(self, payload: AdapterPayload, outcome: str) -> AdapterPayload:
        """`payload`, marked with how it came; says once that the store named hand-over files this
        worker cannot read (the directory is not shared with it: every fetch pays a round trip more)."""
        payload.transport = outcome or "stream"
        if outcome == "missed" and not self._handover_missed_logged:
            self._handover_missed_logged = True
            log.warning(
                "the store handed over an adapter as a file this worker cannot read in %s: is it the "
                "store's --handover-dir on this host? Such adapters are streamed",
                self._handover_dir,
            )
        return payload

    async def digests(self) -> dict[str, str]:
        """adapter id -> digest of everything registered (ListAdapters, all pages)."""
        return await self._on_thread(self._list_digests)

    def _list_digests(self, channel: grpc.Channel) -> dict[str, str]:
        from loraserve.v1 import store_pb2, store_pb2_grpc

        stub = store_pb2_grpc.AdapterStoreStub(channel)
        out: dict[str, str] = {}
        token = ""
        while True:
            resp = stub.ListAdapters(
                store_pb2.ListAdaptersRequest(page_size=1000, page_token=token),
                timeout=self._timeout_s,
                metadata=self._metadata,
            )
            out.update({a.adapter_id: a.digest for a in resp.adapters})
            token = resp.next_page_token
            if not token:
                return out

    async def close(self) -> None:
        if self._process is not None:
            await asyncio.to_thread(self._process.close)
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None
        if self._channel is not None:
            self._channel.close()  # a fetch still streaming ends with CANCELLED
            self._channel = None


class TensorTables:
    """A manifest's tensor table as PayloadTensors, kept for the TABLES most recent layouts: adapters
    of one rank and module set have the same table (names, shapes, offsets), and building its
    hundreds of entries took ~0.5 ms of the event loop per fetch against ~0.03 ms to find it."""

    TABLES = 256

    def __init__(self) -> None:
        self._tables: OrderedDict[bytes, tuple[PayloadTensor, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def payload(self, manifest: bytes, buffer: torch.Tensor, adapter_id: str) -> AdapterPayload:
        """The payload of a serialized AdapterManifest over `buffer`."""
        from loraserve.v1 import store_pb2

        m = store_pb2.AdapterManifest.FromString(manifest)
        owner, digest, rank = m.adapter.adapter_id or adapter_id, m.digest, int(m.rank)
        # every field but the tensors (a new field of the manifest goes here too: a hand-over's file
        # name, the digest, made every fetch miss), cleared in place: ~5x cheaper than a copy
        for field in ("adapter", "total_bytes", "digest", "layout_version", "rank", "handover_file"):
            m.ClearField(field)
        key = m.SerializeToString()  # the tensor table alone
        with self._lock:
            tensors = self._tables.get(key)
            if tensors is not None:
                self._tables.move_to_end(key)
        if tensors is None:
            tensors = tuple(
                PayloadTensor(t.name, tuple(int(s) for s in t.shape), t.dtype, int(t.offset), int(t.nbytes))
                for t in m.tensors
            )
            with self._lock:
                self._tables[key] = tensors
                while len(self._tables) > self.TABLES:
                    self._tables.popitem(last=False)
        return AdapterPayload(owner, digest, rank, buffer, list(tensors))


TENSOR_TABLES = TensorTables()


def _failure_in_process(exc: FetchFailure, adapter_id: str) -> WorkerError:
    """The adapter failure for what the fetch process reported (fetching.process.FetchFailure)."""
    import grpc

    if exc.kind == "rpc":
        code = getattr(grpc.StatusCode, exc.code, grpc.StatusCode.UNKNOWN)
        return failure_for(code, exc.message, adapter_id)
    if exc.kind == "data_loss":
        return AdapterCorrupt(exc.message)
    return DependencyUnavailable(f"fetching adapter {adapter_id!r} from the store failed: {exc.message}")


def failure_of(exc: grpc.RpcError, adapter_id: str) -> WorkerError:
    """The adapter failure for a store RPC error."""
    return failure_for(exc.code(), exc.details() or "", adapter_id)


def failure_for(code: grpc.StatusCode, details: str, adapter_id: str) -> WorkerError:
    """The adapter failure for a store RPC's status."""
    import grpc

    what = f"adapter {adapter_id!r}" if adapter_id else "the adapter store"
    if code == grpc.StatusCode.NOT_FOUND:
        return AdapterNotFound(details or f"{what} is not registered")
    if code == grpc.StatusCode.DATA_LOSS:
        return AdapterCorrupt(details or f"{what}: payload does not match its digest")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return AdapterMismatch(details or f"{what}: the store holds another version")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(details or f"{what}: invalid")
    return DependencyUnavailable(f"cannot reach the adapter store for {what}: {code.name}: {details}")
