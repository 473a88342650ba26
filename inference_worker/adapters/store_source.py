"""Where the worker gets adapters: the adapter store over gRPC (FetchAdapter stream, digest
checked by clients/adapter_fetch.py). Turns the store's answers into adapter failures.

A fetch runs on one of a few fetch threads over a sync channel, not on the worker's event loop:
receiving, copying and hashing tens of MB per adapter there would stall every token stream the
loop serves (measured under serving load at 1,000 adapters: the loop spent a third of its time in
fetches). The thread waits on the network without the interpreter lock and hashes without it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from loraserve.clients.channel import bearer_metadata
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

    from loraserve.v1 import store_pb2_grpc


CHANNEL_OPTIONS = [
    # reconnect quickly once the store is back (the default backoff grows to minutes)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 8 << 20),
]


class StoreSource:
    """Channels to the store, made on first use: a sync one for fetches (on `max_fetches` fetch
    threads) and a grpc.aio one on the running event loop for listings."""

    def __init__(
        self,
        address: str,
        *,
        token: str = "",
        timeout_s: float = 60.0,
        max_retries: int = 2,
        tls_root_cert: bytes | None = None,
        max_fetches: int = 4,
    ) -> None:
        self.address = address
        self._metadata: Sequence[tuple[str, str]] | None = bearer_metadata(token)
        self._timeout_s, self._max_retries = timeout_s, max_retries
        self._tls_root_cert = tls_root_cert
        self._channel: grpc.aio.Channel | None = None
        self._stub: store_pb2_grpc.AdapterStoreStub | None = None
        self._fetch_channel: grpc.Channel | None = None
        self._max_fetches = max_fetches
        self._fetch_threads: concurrent.futures.ThreadPoolExecutor | None = None

    def _store_stub(self) -> store_pb2_grpc.AdapterStoreStub:
        from loraserve.clients.channel import open_aio_channel
        from loraserve.serving import tracing
        from loraserve.v1 import store_pb2_grpc

        if self._stub is None:
            self._channel = open_aio_channel(
                self.address,
                root_certificates=self._tls_root_cert,
                options=CHANNEL_OPTIONS,
                interceptors=tracing.client_interceptors(),  # the store continues the fetch's trace
            )
            self._stub = store_pb2_grpc.AdapterStoreStub(self._channel)
        return self._stub

    async def fetch(self, adapter_id: str, digest: str = "") -> AdapterPayload:
        import grpc

        from loraserve.clients.adapter_fetch import DataLossError, FetchError, fetch_adapter
        from loraserve.clients.channel import open_channel
        from loraserve.serving import tracing

        if self._fetch_threads is None:
            self._fetch_threads = concurrent.futures.ThreadPoolExecutor(
                self._max_fetches, thread_name_prefix="adapter-fetch"
            )
        if self._fetch_channel is None:
            self._fetch_channel = open_channel(
                self.address, root_certificates=self._tls_root_cert, options=CHANNEL_OPTIONS
            )
        # the fetch thread sends the trace context of the span this coroutine runs in
        metadata = tracing.inject(self._metadata) if tracing.enabled() else self._metadata
        run = functools.partial(
            fetch_adapter,
            self._fetch_channel,  # the channel itself: chunks are decoded straight into the buffer
            adapter_id,
            digest=digest,
            max_retries=self._max_retries,
            timeout=self._timeout_s,
            metadata=metadata,
        )
        try:
            fetched = await asyncio.get_running_loop().run_in_executor(self._fetch_threads, run)
        except DataLossError as exc:
            raise AdapterCorrupt(str(exc)) from None
        except FetchError as exc:
            raise DependencyUnavailable(
                f"fetching adapter {adapter_id!r} from the store failed: {exc}"
            ) from None
        except grpc.RpcError as exc:
            raise failure_of(exc, adapter_id) from None
        except RuntimeError as exc:  # the fetch threads were shut down: the worker is stopping
            raise DependencyUnavailable(f"fetching adapter {adapter_id!r} stopped: {exc}") from None
        m = fetched.manifest
        tensors = [
            PayloadTensor(t.name, tuple(int(s) for s in t.shape), t.dtype, int(t.offset), int(t.nbytes))
            for t in m.tensors
        ]
        return AdapterPayload(
            m.adapter.adapter_id or adapter_id, m.digest, int(m.rank), fetched.buffer, tensors
        )

    async def digests(self) -> dict[str, str]:
        """adapter id -> digest of everything registered (ListAdapters, all pages)."""
        import grpc

        from loraserve.v1 import store_pb2

        out: dict[str, str] = {}
        token = ""
        try:
            while True:
                resp = await self._store_stub().ListAdapters(
                    store_pb2.ListAdaptersRequest(page_size=1000, page_token=token),
                    timeout=self._timeout_s,
                    metadata=self._metadata,
                )
                out.update({a.adapter_id: a.digest for a in resp.adapters})
                token = resp.next_page_token
                if not token:
                    return out
        except grpc.RpcError as exc:
            raise failure_of(exc, "") from None

    async def close(self) -> None:
        if self._fetch_threads is not None:
            self._fetch_threads.shutdown(wait=False, cancel_futures=True)
            self._fetch_threads = None
        if self._fetch_channel is not None:
            self._fetch_channel.close()  # a fetch still streaming ends with CANCELLED
            self._fetch_channel = None
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub = None, None


def failure_of(exc: grpc.RpcError, adapter_id: str) -> WorkerError:
    """The adapter failure for a store RPC error."""
    import grpc

    code, details = exc.code(), exc.details() or ""
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
