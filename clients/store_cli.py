"""`loraserve register` and `loraserve adapters`: the store's command line.

    loraserve register ID SOURCE --store HOST:PORT [--overwrite] [--token T]
    loraserve adapters [list | show ID | delete ID] --store HOST:PORT

The address defaults to LORASERVE_STORE (else 127.0.0.1:50051) and the token to LORASERVE_ADMIN_TOKEN.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc
from google.protobuf.json_format import MessageToDict

from loraserve.clients import tables
from loraserve.clients.cli_help import DefaultsHelpFormatter
from loraserve.clients.cli_options import add_json_arg, add_tls_args, print_json, progress
from loraserve.clients.store_client import StoreClient
from loraserve.v1 import adapter_pb2

DEFAULT_STORE = "127.0.0.1:50051"


def _connection_args(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    """The options every command takes; a subcommand repeats them with suppressed defaults so that
    `adapters --store X list` and `adapters list --store X` both work."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--store",
        default=default(os.environ.get("LORASERVE_STORE", DEFAULT_STORE)),
        help="store address HOST:PORT (env LORASERVE_STORE)",
    )
    parser.add_argument(
        "--token",
        default=default(os.environ.get("LORASERVE_ADMIN_TOKEN")),
        help="bearer token: the store's admin token (register, delete, and every read), or its read "
        "token for list and show (env LORASERVE_ADMIN_TOKEN)",
    )
    add_tls_args(parser, suppress)
    add_json_arg(parser, suppress)
    parser.add_argument("--timeout", type=float, default=default(120.0), help="seconds per call")


def _client(args: argparse.Namespace) -> StoreClient:
    return StoreClient(
        args.store, token=args.token, tls=args.tls, root_certificates=args.tls_ca, timeout=args.timeout
    )


def info_dict(info: adapter_pb2.AdapterInfo) -> dict:
    return MessageToDict(info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _fail(exc: grpc.RpcError) -> int:
    print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
    return 1


def register_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="loraserve register",
        description="Register an adapter with a store.",
    )
    parser.add_argument("adapter_id", metavar="ID")
    parser.add_argument(
        "source", metavar="SOURCE", help="s3://bucket/prefix or a directory under the adapter root"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an adapter of the same id")
    _connection_args(parser)
    args = parser.parse_args(list(argv or []))
    try:
        with _client(args) as store:
            # the store reads, validates and optimizes the checkpoint before it answers
            with progress(f"registering {args.adapter_id} (read, validate, optimize)"):
                info = store.register(args.adapter_id, args.source, args.overwrite)
    except grpc.RpcError as exc:
        return _fail(exc)
    if args.json:
        print_json(info_dict(info))
        return 0
    print(
        f"registered {info.adapter_id}: rank {info.rank}, {', '.join(info.target_modules)}, "
        f"{info.size_bytes} bytes {info.dtype}, digest {info.digest}"
    )
    return 0


def format_table(infos: Sequence[adapter_pb2.AdapterInfo]) -> str:
    header = ("ID", "RANK", "ALPHA", "RSLORA", "DTYPE", "BYTES", "MODULES", "DIGEST")
    rows = [
        (
            a.adapter_id,
            str(a.rank),
            f"{a.lora_alpha:g}",
            "yes" if a.use_rslora else "no",
            a.dtype,
            str(a.size_bytes),
            ",".join(m.removesuffix("_proj") for m in a.target_modules),
            a.digest[:12],
        )
        for a in infos
    ]
    return tables.format_table(header, rows)


def adapters_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="loraserve adapters",
        description="List, show or delete a store's adapters.",
    )
    _connection_args(parser)
    sub = parser.add_subparsers(dest="action")
    p_list = sub.add_parser("list", help="list every adapter (default)")
    p_list.add_argument("--page-size", type=int, default=0)
    p_show = sub.add_parser("show", help="show one adapter (JSON)")
    p_show.add_argument("adapter_id", metavar="ID")
    p_delete = sub.add_parser("delete", help="delete an adapter")
    p_delete.add_argument("adapter_id", metavar="ID")
    for p in (p_list, p_show, p_delete):
        _connection_args(p, suppress=True)
    args = parser.parse_args(list(argv or []))
    try:
        with _client(args) as store:
            if args.action in (None, "list"):
                infos = list(store.list(getattr(args, "page_size", 0)))
                if args.json:
                    print_json([info_dict(i) for i in infos])
                else:
                    print(format_table(infos))
                    print(f"{len(infos)} adapter(s)")
            elif args.action == "show":  # JSON with or without --json
                print_json(info_dict(store.get(args.adapter_id)))
            else:
                info = store.delete(args.adapter_id)
                if args.json:
                    print_json(info_dict(info))
                else:
                    print(f"deleted {info.adapter_id} (digest {info.digest})")
    except grpc.RpcError as exc:
        return _fail(exc)
    return 0
