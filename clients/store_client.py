"""Typed clients of the AdapterStore service, sync (`StoreClient`) and asyncio (`AsyncStoreClient`).

    with StoreClient("127.0.0.1:50051", token="secret") as store:
        info = store.register("my-adapter", "s3://adapters/my-adapter")
        for a in store.list():          # pages through ListAdapters
            print(a.adapter_id, a.rank)
        adapter = store.fetch("my-adapter")   # tensors rebuilt from the stream, digest checked

Failures surface as grpc.RpcError with the store's status code and message. The channel sends
HTTP/2 keepalive pings as the worker clients' do (`channel.Keepalive`; None: off): a call to a store
that is gone, a fetch in mid-stream too, ends UNAVAILABLE within its interval and timeout.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from loraserve.clients.channel import (
    KEEPALIVE,
    AsyncChannelClient,
    ChannelClient,
    Keepalive,
    bearer_metadata,
    open_aio_channel,
    open_channel,
)
from loraserve.v1 import adapter_pb2, store_pb2, store_pb2_grpc

if TYPE_CHECKING:
    from loraserve.clients.adapter_fetch import FetchedAdapter

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.http2.lookahead_bytes", 8 << 20),  # a fetch's stream runs up to 8 MiB ahead of its reader
]


def _options(tls_server_name: str | None, keepalive: Keepalive | None) -> list[tuple[str, object]]:
    opts: list[tuple[str, object]] = list(CHANNEL_OPTIONS)
    if keepalive is not None:
        opts += keepalive.options()
    if tls_server_name:
        opts.append(("grpc.ssl_target_name_override", tls_server_name))
    return opts


class _StoreClientBase:
    """What both clients share: the channel (sync or grpc.aio, opened by the subclass's `_open`)
    with its keepalive, the stub, the call timeout and the bearer metadata."""

    channel: Any
    stub: Any
    _open: Callable[..., Any]  # open_channel or open_aio_channel

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | str | Path | None = None,
        tls_server_name: str | None = None,
        timeout: float | None = 60.0,
        keepalive: Keepalive | None = KEEPALIVE,
    ) -> None:
        options = _options(tls_server_name, keepalive)
        self.channel = self._open(address, tls=tls, root_certificates=root_certificates, options=options)
        self.stub = store_pb2_grpc.AdapterStoreStub(self.channel)
        self.timeout = timeout
        self._md = bearer_metadata(token)


class StoreClient(_StoreClientBase, ChannelClient):
    channel: grpc.Channel
    stub: store_pb2_grpc.AdapterStoreStub
    _open = staticmethod(open_channel)

    def register(self, adapter_id: str, source: str, overwrite: bool = False) -> adapter_pb2.AdapterInfo:
        req = store_pb2.RegisterAdapterRequest(adapter_id=adapter_id, source=source, overwrite=overwrite)
        return self.stub.RegisterAdapter(req, timeout=self.timeout, metadata=self._md)

    def get(self, adapter_id: str) -> adapter_pb2.AdapterInfo:
        return self.stub.GetAdapter(
            store_pb2.GetAdapterRequest(adapter_id=adapter_id), timeout=self.timeout, metadata=self._md
        )

    def list_page(self, page_size: int = 0, page_token: str = "") -> store_pb2.ListAdaptersResponse:
        req = store_pb2.ListAdaptersRequest(page_size=page_size, page_token=page_token)
        return self.stub.ListAdapters(req, timeout=self.timeout, metadata=self._md)

    def list(self, page_size: int = 0) -> Iterator[adapter_pb2.AdapterInfo]:
        token = ""
        while True:
            page = self.list_page(page_size, token)
            yield from page.adapters
            token = page.next_page_token
            if not token:
                return

    def delete(self, adapter_id: str) -> adapter_pb2.AdapterInfo:
        req = store_pb2.DeleteAdapterRequest(adapter_id=adapter_id)
        return self.stub.DeleteAdapter(req, timeout=self.timeout, metadata=self._md).adapter

    def fetch(self, adapter_id: str, digest: str = "", pin_memory: bool | None = None) -> FetchedAdapter:
        from loraserve.clients.adapter_fetch import fetch_adapter  # torch: loaded by fetching clients only

        return fetch_adapter(
            self.channel,
            adapter_id,
            digest=digest,
            timeout=self.timeout,
            metadata=self._md,
            pin_memory=pin_memory,
        )


class AsyncStoreClient(_StoreClientBase, AsyncChannelClient):
    channel: grpc.aio.Channel
    stub: store_pb2_grpc.AdapterStoreAsyncStub
    _open = staticmethod(open_aio_channel)

    async def register(
        self, adapter_id: str, source: str, overwrite: bool = False
    ) -> adapter_pb2.AdapterInfo:
        req = store_pb2.RegisterAdapterRequest(adapter_id=adapter_id, source=source, overwrite=overwrite)
        return await self.stub.RegisterAdapter(req, timeout=self.timeout, metadata=self._md)

    async def get(self, adapter_id: str) -> adapter_pb2.AdapterInfo:
        return await self.stub.GetAdapter(
            store_pb2.GetAdapterRequest(adapter_id=adapter_id), timeout=self.timeout, metadata=self._md
        )

    async def list_page(self, page_size: int = 0, page_token: str = "") -> store_pb2.ListAdaptersResponse:
        req = store_pb2.ListAdaptersRequest(page_size=page_size, page_token=page_token)
        return await self.stub.ListAdapters(req, timeout=self.timeout, metadata=self._md)

    async def list(self, page_size: int = 0) -> AsyncIterator[adapter_pb2.AdapterInfo]:
        token = ""
        while True:
            page = await self.list_page(page_size, token)
            for a in page.adapters:
                yield a
            token = page.next_page_token
            if not token:
                return

    async def delete(self, adapter_id: str) -> adapter_pb2.AdapterInfo:
        req = store_pb2.DeleteAdapterRequest(adapter_id=adapter_id)
        return (await self.stub.DeleteAdapter(req, timeout=self.timeout, metadata=self._md)).adapter

    async def fetch(
        self, adapter_id: str, digest: str = "", pin_memory: bool | None = None
    ) -> FetchedAdapter:
        from loraserve.clients.adapter_fetch import (
            fetch_adapter_async,  # torch: loaded by fetching clients only
        )

        return await fetch_adapter_async(
            self.channel,
            adapter_id,
            digest=digest,
            timeout=self.timeout,
            metadata=self._md,
            pin_memory=pin_memory,
        )
