"""Where the worker gets adapters: the adapter store over gRPC (FetchAdapter stream, digest
checked by clients/adapter_fetch.py). Turns the store's answers into adapter failures."""

from __future__ import annotations

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


class StoreSource:
    """One grpc.aio channel to the store, made on first use on the running event loop."""

    def __init__(
        self,
        address: str,
        *,
        token: str = "",
        timeout_s: float = 60.0,
        max_retries: int = 2,
        tls_root_cert: bytes | None = None,
    ) -> None:
        self.address = address
        self._metadata: Sequence[tuple[str, str]] | None = bearer_metadata(token)
        self._timeout_s, self._max_retries = timeout_s, max_retries
        self._tls_root_cert = tls_root_cert
        self._channel: grpc.aio.Channel | None = None
        self._stub: store_pb2_grpc.AdapterStoreStub | None = None

    def _store_stub(self) -> store_pb2_grpc.AdapterStoreStub:
        from loraserve.clients.channel import open_aio_channel
        from loraserve.serving import tracing
        from loraserve.v1 import store_pb2_grpc

        if self._stub is None:
            # reconnect quickly once the store is back (the default backoff grows to minutes)
            options = [
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.min_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
                ("grpc.max_receive_message_length", 8 << 20),
            ]
            self._channel = open_aio_channel(
                self.address,
                root_certificates=self._tls_root_cert,
                options=options,
                interceptors=tracing.client_interceptors(),  # the store continues the fetch's trace
            )
            self._stub = store_pb2_grpc.AdapterStoreStub(self._channel)
        return self._stub

    async def fetch(self, adapter_id: str, digest: str = "") -> AdapterPayload:
        import grpc

        from loraserve.clients.adapter_fetch import DataLossError, FetchError, fetch_adapter_async

        try:
            self._store_stub()
            # the channel itself: the fetch client then decodes chunks straight into the pinned buffer
            fetched = await fetch_adapter_async(
                self._channel,
                adapter_id,
                digest=digest,
                max_retries=self._max_retries,
                timeout=self._timeout_s,
                metadata=self._metadata,
            )
        except DataLossError as exc:
            raise AdapterCorrupt(str(exc)) from None
        except FetchError as exc:
            raise DependencyUnavailable(
                f"fetching adapter {adapter_id!r} from the store failed: {exc}"
            ) from None
        except grpc.RpcError as exc:
            raise failure_of(exc, adapter_id) from None
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
