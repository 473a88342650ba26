"""Opening a gRPC channel to a loraserve service (plain or TLS, sync or asyncio) and the bearer
token metadata its calls carry."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import grpc

Options = Sequence[tuple[str, object]]
C = TypeVar("C", bound="ChannelClient")
A = TypeVar("A", bound="AsyncChannelClient")


class ChannelClient:
    """A client owning a sync channel: `close()`, and a context manager that closes it."""

    channel: grpc.Channel

    def close(self) -> None:
        self.channel.close()

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncChannelClient:
    """The grpc.aio twin of ChannelClient (`await close()`, `async with`)."""

    channel: grpc.aio.Channel

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self: A) -> A:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The `authorization: Bearer <token>` call metadata; None without a token."""
    return (("authorization", f"Bearer {token}"),) if token else None


def _credentials(tls: bool, root_certificates: bytes | str | Path | None) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting root_certificates (PEM bytes or a file), the system roots when only tls
    is set, None for a plain channel."""
    if not tls and root_certificates is None:
        return None
    if isinstance(root_certificates, (str, Path)):
        root_certificates = Path(root_certificates).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


def open_channel(
    address: str,
    *,
    tls: bool = False,
    root_certificates: bytes | str | Path | None = None,
    options: Options = (),
) -> grpc.Channel:
    """A sync channel, TLS when tls is set or root certificates are given."""
    creds = _credentials(tls, root_certificates)
    return (
        grpc.secure_channel(address, creds, options=options)
        if creds
        else grpc.insecure_channel(address, options=options)
    )


def open_aio_channel(
    address: str,
    *,
    tls: bool = False,
    root_certificates: bytes | str | Path | None = None,
    options: Options = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """The grpc.aio twin of open_channel; `interceptors` see every call (e.g. trace propagation)."""
    creds = _credentials(tls, root_certificates)
    chosen = list(interceptors) or None
    return (
        grpc.aio.secure_channel(address, creds, options=options, interceptors=chosen)
        if creds
        else grpc.aio.insecure_channel(address, options=options, interceptors=chosen)
    )
