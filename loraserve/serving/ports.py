"""Listening on a port, for every server (the gRPC store and worker, an HTTP gateway): one process
per port, and a port that cannot be had is one clear error, `PortUnavailable`, whose message is
the whole story ("cannot listen on 127.0.0.1:50051: Address already in use").

gRPC turns SO_REUSEPORT on by default: a second server on a busy port then binds too and the
kernel spreads connections over both. `grpc_server` turns it off (but for the processes of one
group that share a port on purpose: a worker's front processes); `bind_grpc_port` checks the port
with a plain socket first, so a busy one fails before gRPC logs its own lines about it. A port that
a group shares with SO_REUSEPORT can be joined by any other process of the same user that turns it
on too (Linux allows no other user's): give each worker a port of its own.
`listen_socket` is the same for a server that takes a ready socket (uvicorn's `sockets=`).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

# The line a server prints once it listens ("adapter store listening on HOST:PORT (...)",
# "worker ID listening on HOST:PORT ..."): a caller that started it on port 0 reads the bound
# address from it (`listening_address`).
LISTENING = re.compile(r"listening on (\S+?):(\d+)\b")


def listening_address(text: str) -> str | None:
    """HOST:PORT of the first "listening on" line in a server's output `text`, else None."""
    found = LISTENING.search(text)
    return f"{found.group(1)}:{found.group(2)}" if found else None


class PortUnavailable(OSError):
    """The port is taken (or the address cannot be bound); str() is the one line to print."""


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening, non-blocking TCP socket on host:port (port 0 picks a free one), without
    SO_REUSEPORT; raises PortUnavailable."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    # SO_REUSEADDR only lets a restarted server bind past connections in TIME_WAIT: on Linux it
    # never lets two sockets listen on one port
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host or "0.0.0.0", port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise PortUnavailable(f"cannot listen on {_address(host, port)}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


# What the servers accept of a client's HTTP/2 keepalive pings (clients.channel.Keepalive): one a
# second per connection, with or without calls running. gRPC's defaults (one per 5 minutes, none
# while no call runs) take a keepalive client's pings for abuse and answer the third with GOAWAY
# (too_many_pings), which fails a stream still waiting for its first token with UNAVAILABLE.
MIN_PING_INTERVAL_S = 1.0
KEEPALIVE_POLICY: tuple[tuple[str, Any], ...] = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", round(MIN_PING_INTERVAL_S * 1000)),
)


def grpc_server(
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    options: Sequence[tuple[str, Any]] = (),
    share_port: bool = False,
) -> grpc.aio.Server:
    """A grpc.aio server that cannot share its port with another process, unless `share_port`:
    then the processes of one group (a worker's front processes) all bind it, SO_REUSEPORT on,
    and the kernel spreads the clients' connections over them. It accepts the clients' keepalive
    pings (KEEPALIVE_POLICY)."""
    return grpc.aio.server(
        interceptors=list(interceptors),
        options=[*options, *KEEPALIVE_POLICY, ("grpc.so_reuseport", int(share_port))],
    )


def bind_grpc_port(
    server: grpc.aio.Server,
    host: str,
    port: int,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    joining: bool = False,
) -> int:
    """Listen on host:port (port 0 picks one), with TLS when a certificate and key are given;
    -> the bound port. Raises PortUnavailable. `joining`: the port is already bound by the first
    process of this one's group (`grpc_server(share_port=True)` in each), so it is not checked."""
    if joining and port == 0:
        raise ValueError("joining a group's port needs the port the first process bound")
    if port != 0 and not joining:
        listen_socket(host, port).close()  # a busy port fails here, in one line
    address = _address(host, port)
    try:
        if tls_cert and tls_key:
            creds = grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())])
            bound = server.add_secure_port(address, creds)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises where older versions returned 0
        bound = 0
    if bound == 0:
        raise PortUnavailable(f"cannot listen on {address}: taken, or not an address of this host")
    return bound
