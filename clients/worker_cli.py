"""`loraserve generate` (stream a completion to the terminal; chat messages, n completions,
logprobs and penalties) and `loraserve slots` (a worker's
adapters: list, load, unload, pin, unpin)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from loraserve.clients.cli_help import DefaultsHelpFormatter
from loraserve.clients.cli_options import (
    add_json_arg,
    add_tls_args,
    nonnegative_int,
    positive_int,
    print_json,
    stream_interval,
)
from loraserve.clients.router import WorkerRouter, discover_workers
from loraserve.clients.tables import format_table
from loraserve.clients.worker_client import WorkerClient
from loraserve.clients.worker_messages import Completion
from loraserve.contract.usage import Usage
from loraserve.v1 import worker_pb2


def _messages(args: argparse.Namespace, p: argparse.ArgumentParser) -> list[dict[str, str]] | None:
    """Chat messages from --messages FILE, repeated --message ROLE:CONTENT and --chat PROMPT."""
    messages: list[dict[str, str]] = []
    if args.messages:
        try:
            raw = sys.stdin.read() if args.messages == "-" else Path(args.messages).read_text()
            loaded = json.loads(raw)
        except (OSError, ValueError) as exc:
            p.error(f"--messages {args.messages}: {exc}")
        if not isinstance(loaded, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content", ""), str)
            for m in loaded
        ):
            p.error('--messages needs a JSON list of {"role": ..., "content": ...} objects')
        messages += [{"role": m["role"], "content": m.get("content", "")} for m in loaded]
    for m in args.message:
        role, sep, content = m.partition(":")
        if not sep or not role:
            p.error(f"--message needs ROLE:CONTENT, got {m!r}")
        messages.append({"role": role, "content": content})
    if args.chat and args.prompt is not None:
        messages.append({"role": "user", "content": args.prompt})
    if messages and args.prompt is not None and not args.chat:
        p.error("give either a prompt or chat messages (add --chat to send the prompt as a user message)")
    if not messages and args.prompt is None:
        p.error("give a prompt, --chat PROMPT, --message ROLE:CONTENT or --messages FILE")
    return messages or None


def _logprob_lines(c: Completion) -> str:
    rows = [
        (
            repr(lp.token),
            f"{lp.logprob:.4f}",
            "  ".join(f"{a.token!r} {a.logprob:.3f}" for a in lp.top_logprobs),
        )
        for lp in c.logprobs
    ]
    return format_table(("TOKEN", "LOGPROB", "TOP ALTERNATIVES"), rows)


def _print_usage(u: Usage, finish_reason: str | None) -> None:
    print(
        f"[{finish_reason}] prompt {u.prompt_tokens} tokens, completion "
        f"{u.completion_tokens} tokens, queue {u.queue_time_ms:.1f} ms, "
        f"first token {u.time_to_first_token_ms:.1f} ms, total {u.total_time_ms:.1f} ms",
        file=sys.stderr,
    )


def generate_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="loraserve generate",
        description="Generate text through a worker.",
    )
    p.add_argument("prompt", nargs="?", help="prompt text (with --chat: the user's message)")
    p.add_argument(
        "--worker",
        default=os.environ.get("LORASERVE_WORKER", "127.0.0.1:50052"),
        help="worker address host:port, or several separated by commas (routed by adapter)",
    )
    p.add_argument(
        "--redis-url",
        default=None,
        help="route across the live workers of the fleet registered in this Redis instead",
    )
    p.add_argument("--redis-prefix", default=os.environ.get("LORASERVE_REDIS_PREFIX", "loraserve:"))
    p.add_argument("--adapter", default="", help="adapter id (optionally id@digest); empty = base model")
    chat = p.add_argument_group("chat (rendered by the worker with the model's chat template)")
    chat.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    chat.add_argument(
        "--message",
        action="append",
        default=[],
        metavar="ROLE:CONTENT",
        help="a chat message, e.g. system:'Be brief.' (repeatable, in order, before --chat's prompt)",
    )
    chat.add_argument(
        "--messages", metavar="FILE", help='JSON list of {"role", "content"} messages ("-" = stdin)'
    )
    chat.add_argument(
        "--no-generation-prompt",
        action="store_true",
        help="do not open an assistant turn after the messages",
    )
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="completion i samples with seed + i")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "-n", type=positive_int, default=1, help="completions of the prompt (its KV computed once)"
    )
    p.add_argument("--logprobs", action="store_true", help="print each token's log-probability")
    p.add_argument(
        "--top-logprobs",
        type=nonnegative_int,
        default=0,
        help="alternatives per token (0..20), implies --logprobs",
    )
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty [-2, 2]")
    p.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="Hugging Face repetition penalty (> 0)"
    )
    p.add_argument(
        "--stream-interval",
        type=stream_interval,
        default=0,
        metavar="K",
        help="a streamed completion's tokens arrive K to a message (its first at once); "
        "0 = the worker's default",
    )
    p.add_argument("--token", default=os.environ.get("LORASERVE_GENERATE_TOKEN"), help="bearer token")
    add_tls_args(p)
    add_json_arg(p)
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="deadline of the whole generation in seconds (default: 600 s; --stream: none, but the "
        "first tokens must come within 60 s)",
    )
    p.add_argument("--usage", action="store_true", help="print token counts and timings at the end")
    args = p.parse_args(list(argv or []))
    messages = _messages(args, p)
    try:
        addresses = (
            discover_workers(args.redis_url, args.redis_prefix)
            if args.redis_url
            else [a.strip() for a in args.worker.split(",") if a.strip()]
        )
    except Exception as exc:
        print(f"loraserve generate: cannot discover workers: {exc}", file=sys.stderr)
        return 1
    if not addresses:
        print("loraserve generate: no live worker", file=sys.stderr)
        return 1
    kw = dict(
        messages=messages,
        add_generation_prompt=False if args.no_generation_prompt else None,
        adapter_id=args.adapter,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        n=args.n,
        logprobs=args.logprobs or args.top_logprobs > 0,
        top_logprobs=args.top_logprobs,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        stream_interval=args.stream_interval,
        timeout=args.timeout,
    )
    prompt = None if args.chat else args.prompt
    try:
        client = (
            WorkerClient(addresses[0], token=args.token, tls_ca=args.tls_ca, tls=args.tls)
            if len(addresses) == 1
            else WorkerRouter(addresses, token=args.token, tls_ca=args.tls_ca, tls=args.tls)
        )
        with client:
            if args.json:  # the whole generation: completions, token ids, logprobs, usage
                print_json(dataclasses.asdict(client.generate(prompt, **kw)))
            elif args.n == 1 and not kw["logprobs"]:  # stream one completion to the terminal
                for delta in client.generate_stream(prompt, **kw):
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                    if delta.usage is not None:
                        sys.stdout.write("\n")
                        if args.usage:
                            _print_usage(delta.usage, delta.finish_reason)
            else:
                out = client.generate(prompt, **kw)
                for c in out.completions:
                    if len(out.completions) > 1:
                        print(f"--- completion {c.index} [{c.finish_reason}]")
                    print(c.text)
                    if c.logprobs:
                        print(_logprob_lines(c))
                if args.usage:
                    _print_usage(out.usage, out.finish_reason)
    except grpc.RpcError as exc:
        print(f"loraserve generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


_TIER_NAMES = {
    worker_pb2.ADAPTER_TIER_GPU: "gpu",
    worker_pb2.ADAPTER_TIER_CPU: "cpu",
    worker_pb2.ADAPTER_TIER_LOADING: "loading",
}


def format_residency(adapters: Sequence[worker_pb2.WorkerAdapter]) -> str:
    header = (
        "ID",
        "TIER",
        "SLOT",
        "PINNED",
        "RANK",
        "BYTES",
        "REQUESTS",
        "TOKENS",
        "RUNNING",
        "LAST USED",
        "DIGEST",
    )
    rows = [
        (
            a.adapter_id,
            _TIER_NAMES.get(a.tier, "-"),
            str(a.slot) if a.slot >= 0 else "-",
            "yes" if a.pinned else "no",
            str(a.rank),
            str(a.size_bytes),
            str(a.num_requests),
            str(a.num_tokens),
            str(a.num_running),
            a.last_used.ToDatetime().strftime("%H:%M:%S") if a.last_used.seconds else "-",
            a.digest[:12],
        )
        for a in adapters
    ]
    return format_table(header, rows)


def _adapter_dict(a: worker_pb2.WorkerAdapter) -> dict:
    out = MessageToDict(a, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    out["tier"] = _TIER_NAMES.get(a.tier, "")
    return out


def slots_main(argv: Sequence[str] | None = None) -> int:
    """`loraserve slots`: what one worker holds, and the admin verbs that change it."""
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="loraserve slots",
        description="List, load, unload, pin or unpin the adapters a worker holds.",
    )
    p.add_argument("action", nargs="?", default="list", choices=("list", "load", "unload", "pin", "unpin"))
    p.add_argument("adapter_id", nargs="?", metavar="ID", help="adapter id (all actions but list)")
    p.add_argument("--tier", choices=("gpu", "cpu"), default="gpu", help="tier to load into")
    p.add_argument(
        "--worker",
        default=os.environ.get("LORASERVE_WORKER", "127.0.0.1:50052"),
        help="worker address host:port",
    )
    p.add_argument("--token", default=os.environ.get("LORASERVE_ADMIN_TOKEN"), help="admin bearer token")
    add_tls_args(p)
    add_json_arg(p)
    p.add_argument("--timeout", type=float, default=60.0, help="deadline in seconds")
    args = p.parse_args(list(argv or []))
    if args.action != "list" and not args.adapter_id:
        p.error(f"{args.action} needs an adapter ID")
    try:
        with WorkerClient(
            args.worker, admin_token=args.token, tls_ca=args.tls_ca, tls=args.tls, timeout=args.timeout
        ) as w:
            if args.action == "unload":
                unloaded = w.unload_adapter(args.adapter_id)
                if args.json:
                    print_json({"adapter_id": args.adapter_id, "unloaded": unloaded})
                else:
                    print(f"{args.adapter_id}: {'unloaded' if unloaded else 'not held'}")
                return 0
            if args.action == "list":
                held = w.list_adapters()
            elif args.action == "load":
                held = [w.load_adapter(args.adapter_id, args.tier)]
            else:
                held = [w.pin_adapter(args.adapter_id, args.action == "pin")]
            if args.json:
                print_json([_adapter_dict(a) for a in held])
            else:
                print(format_residency(held))
                if args.action == "list":
                    print(f"{len(held)} adapter(s)")
    except grpc.RpcError as exc:
        print(f"loraserve slots: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0
