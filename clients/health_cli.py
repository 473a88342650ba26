"""`loraserve health`: asks a server's standard health service (grpc.health.v1) whether it serves.
Container health checks run it (the images carry no grpc_health_probe binary).

    loraserve health HOST:PORT [--service NAME] [--timeout S] [--tls] [--tls-ca PEM] [--json]

Exit status: 0 SERVING; 1 any other answer (NOT_SERVING while starting or draining, or a service
name the server does not know); 2 bad usage; 3 no answer (unreachable, deadline exceeded).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc

from loraserve.clients.channel import open_channel
from loraserve.clients.cli_help import DefaultsHelpFormatter
from loraserve.clients.cli_options import add_json_arg, add_tls_args, print_json

SERVING, NOT_SERVING, USAGE, NO_ANSWER = 0, 1, 2, 3


def health_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="loraserve health",
        description="Check a server through grpc.health.v1 (exit 0 when SERVING).",
    )
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument(
        "--service",
        default="",
        help="service to ask about, e.g. loraserve.v1.AdapterStore (default: the whole server)",
    )
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    add_tls_args(parser)
    add_json_arg(parser)
    args = parser.parse_args(list(argv or []))
    if args.timeout <= 0:
        parser.error("--timeout must be > 0")
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError:
        print(
            "loraserve health needs grpcio-health-checking (pip install 'loraserve[server]')", file=sys.stderr
        )
        return USAGE
    target = f"{args.address} {args.service}".rstrip()
    with open_channel(args.address, tls=args.tls, root_certificates=args.tls_ca) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            print(f"{target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            # NOT_FOUND: the server answered, it just does not know that service name
            return NOT_SERVING if exc.code() == grpc.StatusCode.NOT_FOUND else NO_ANSWER
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if args.json:
        print_json({"address": args.address, "service": args.service, "status": status})
    else:
        print(f"{target}: {status}")
    return SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else NOT_SERVING
