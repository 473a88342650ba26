"""Opening a gRPC channel to a loraserve service (plain or TLS, sync or asyncio), its keepalive,
and the bearer token metadata its calls carry."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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


# The services accept a client's keepalive ping once a second per connection
# (loraserve.serving.ports.KEEPALIVE_POLICY); a client pings at most every other second, so a ping
# that timer jitter sends early is never taken for abuse (the server's GOAWAY, too_many_pings).
MIN_KEEPALIVE_S = 2.0


@dataclass(frozen=True)
class Keepalive:
    """HTTP/2 keepalive of a channel: after `interval_s` without a frame from the server the
    client pings it, and a ping unanswered for `timeout_s` closes the connection, failing its calls
    with UNAVAILABLE. A stream waiting on a peer that is gone (host down, network cut, process
    stopped) ends within interval_s + timeout_s, whatever its deadline; pings go on while no call
    runs, so a dead idle connection is found before a call is sent on it."""

    interval_s: float = 30.0
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.interval_s < MIN_KEEPALIVE_S:
            raise ValueError(f"keepalive interval must be >= {MIN_KEEPALIVE_S} s, got {self.interval_s}")
        if self.timeout_s <= 0:
            raise ValueError(f"keepalive timeout must be > 0, got {self.timeout_s}")

    def options(self) -> list[tuple[str, object]]:
        return [
            ("grpc.keepalive_time_ms", round(self.interval_s * 1000)),
            ("grpc.keepalive_timeout_ms", round(self.timeout_s * 1000)),
            # any ping's answer, a flow-control (BDP) ping's too: a keepalive ping waits behind one
            # in flight, which without this waits 60 s for its answer
            ("grpc.http2.ping_timeout_ms", round(self.timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            # no cap on pings while neither side sends data (gRPC stops after 2: a stream waiting
            # for its first token, or an idle connection, would go unchecked)
            ("grpc.http2.max_pings_without_data", 0),
        ]


KEEPALIVE = Keepalive()  # the default of every client channel to a service: worker and store


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
