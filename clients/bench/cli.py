"""`loraserve bench`: load a worker, a fleet (through the router) or the OpenAI endpoint with a
reproducible request stream and report throughput, latency percentiles and adapter activity.

    loraserve bench --worker 127.0.0.1:50052 --metrics-url 127.0.0.1:9090 \\
        --num-adapters 100 --popularity zipf --zipf-exponent 1.0 --base-share 0.1 \\
        --rate 8 --duration 60 --prompt-len 128:512 --output-len 64:256 --slo-ttft-ms 500 \\
        --result-json results.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from loraserve.clients.bench.openai_target import OpenAITarget
from loraserve.clients.bench.results import format_summary, records_as_dicts
from loraserve.clients.bench.runner import RunLimits, check_processes, run_benchmark
from loraserve.clients.bench.targets import RouterTarget, Sampling, Target, TargetError, WorkerTarget
from loraserve.clients.bench.workload import (
    POPULARITIES,
    RequestStream,
    WorkloadSpec,
    adapter_ids,
    load_prompts,
)
from loraserve.clients.cli_help import DefaultsHelpFormatter
from loraserve.clients.cli_options import add_tls_args, positive_int, stream_interval
from loraserve.clients.router import discover_workers


def length_range(text: str) -> tuple[int, int]:
    """`N` or `LOW:HIGH` (inclusive) token counts."""
    lo, _, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH, got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"need 1 <= LOW <= HIGH, got {text!r}")
    return low, high


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="loraserve bench",
        description="Benchmark a worker, a fleet or the OpenAI endpoint under a multi-adapter workload.",
    )
    t = p.add_argument_group("target (one of)")
    t.add_argument(
        "--worker",
        default=os.environ.get("LORASERVE_WORKER", "127.0.0.1:50052"),
        help="worker address host:port; several separated by commas are routed by adapter",
    )
    t.add_argument("--redis-url", default=None, help="route across the live workers registered in this Redis")
    t.add_argument("--redis-prefix", default=os.environ.get("LORASERVE_REDIS_PREFIX", "loraserve:"))
    t.add_argument(
        "--openai-url", default=None, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1"
    )
    t.add_argument(
        "--openai-model", default="", help="model name of base-model requests (default: the first listed)"
    )
    t.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key of the OpenAI endpoint"
    )
    t.add_argument("--token", default=os.environ.get("LORASERVE_GENERATE_TOKEN"), help="worker bearer token")
    t.add_argument(
        "--connections",
        type=positive_int,
        default=1,
        help="connections to each worker, taken in turn by the requests (a worker with several front "
        "processes, --stream-processes, gets each connection on one of them); not with --openai-url",
    )
    add_tls_args(t)

    load = p.add_argument_group("load")
    load.add_argument(
        "--rate", type=float, default=None, help="Poisson arrivals, requests/s (default: closed loop)"
    )
    load.add_argument(
        "--concurrency",
        type=positive_int,
        default=None,
        help="closed loop: requests kept in flight (default 1 without --rate); with --rate: the in-flight cap",
    )
    load.add_argument(
        "--num-requests",
        type=positive_int,
        default=None,
        help="requests to send (default 100 without --duration)",
    )
    load.add_argument("--duration", type=float, default=None, help="seconds to send for")
    load.add_argument(
        "--processes",
        type=positive_int,
        default=1,
        help="generator processes sharing the stream (each its own connections and event loop): one "
        "reads a few tens of thousands of streamed messages a second",
    )

    w = p.add_argument_group("workload")
    w.add_argument("--num-adapters", type=int, default=0, help="N adapter ids, from --adapter-format")
    w.add_argument(
        "--adapter-format", default="adapter-{i:04d}", help="adapter id format with field {i} (0-based)"
    )
    w.add_argument(
        "--adapter-ids", default=None, help="comma-separated adapter ids instead (most popular first)"
    )
    w.add_argument("--popularity", choices=POPULARITIES, default="uniform")
    w.add_argument("--zipf-exponent", type=float, default=1.0)
    w.add_argument(
        "--base-share",
        type=float,
        default=None,
        help="share of base-model requests (default 0, 1 without adapters)",
    )
    w.add_argument("--prompt-len", type=length_range, default=(32, 32), help="prompt tokens, N or LOW:HIGH")
    w.add_argument("--output-len", type=length_range, default=(32, 32), help="max_tokens, N or LOW:HIGH")
    w.add_argument(
        "--prompts", default=None, help='JSONL file of prompts: "text" or {"prompt": ..., "max_tokens": ...}'
    )
    w.add_argument(
        "--vocab-size", type=int, default=None, help="synthetic prompt token range (default: the worker's)"
    )
    w.add_argument("--seed", type=int, default=0, help="seed of the request stream")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly max_tokens (default on)",
    )
    w.add_argument("--timeout", type=float, default=None, help="per-request deadline in seconds")
    w.add_argument(
        "--stream-interval",
        type=stream_interval,
        default=0,
        metavar="K",
        help="ask each worker or router request for its tokens K to a message, the first alone and at "
        "once: a generator reads ~K times fewer messages (TTFT is unchanged, TPOT spans the first to "
        "the last token); 0 = the worker's default, one a message unless its --stream-interval",
    )

    r = p.add_argument_group("report")
    r.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT target for SLO attainment")
    r.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        help="a worker's Prometheus endpoint (host:port or URL; repeatable): adapter loads, evictions, fetches",
    )
    r.add_argument("--result-json", default=None, help="write the summary (and --save-requests) as JSON here")
    r.add_argument("--save-requests", action="store_true", help="include every request's record in the JSON")
    r.add_argument(
        "--progress-interval", type=float, default=2.0, help="seconds between progress lines; 0 = none"
    )
    return p


def build_target(args: argparse.Namespace) -> Target:
    sampling = Sampling(args.temperature, args.ignore_eos, args.timeout, args.stream_interval)
    if args.openai_url:
        if args.stream_interval:
            raise ValueError(
                "--stream-interval is for a worker or the router (GenerateStream), not --openai-url"
            )
        return OpenAITarget(args.openai_url, sampling, base_model=args.openai_model, api_key=args.api_key)
    addresses = (
        discover_workers(args.redis_url, args.redis_prefix)
        if args.redis_url
        else [a.strip() for a in args.worker.split(",") if a.strip()]
    )
    if not addresses:
        raise TargetError("no live worker", args.redis_url or args.worker)
    if len(addresses) == 1 and not args.redis_url:
        return WorkerTarget(
            addresses[0],
            sampling,
            token=args.token,
            tls_ca=args.tls_ca,
            tls=args.tls,
            connections=args.connections,
        )
    return RouterTarget(
        addresses, sampling, token=args.token, tls_ca=args.tls_ca, tls=args.tls, connections=args.connections
    )


def build_spec(args: argparse.Namespace, vocab_size: int | None) -> WorkloadSpec:
    ids = (
        tuple(a.strip() for a in args.adapter_ids.split(",") if a.strip())
        if args.adapter_ids
        else adapter_ids(args.num_adapters, args.adapter_format)
    )
    base_share = args.base_share if args.base_share is not None else (0.0 if ids else 1.0)
    prompts = load_prompts(args.prompts) if args.prompts else ()
    if not prompts and vocab_size is None:
        raise ValueError("synthetic prompts need --vocab-size (the target does not report one)")
    return WorkloadSpec(
        adapter_ids=ids,
        popularity=args.popularity,
        zipf_exponent=args.zipf_exponent,
        base_share=base_share,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        prompts=prompts,
        vocab_size=vocab_size or 1,
        rate=args.rate,
        seed=args.seed,
    )


def build_limits(args: argparse.Namespace) -> RunLimits:
    n = args.num_requests if args.num_requests is not None or args.duration is not None else 100
    open_loop = args.rate is not None
    concurrency = args.concurrency if args.concurrency is not None or open_loop else 1
    return RunLimits(n, args.duration, concurrency, open_loop)


async def _bench(args: argparse.Namespace) -> int:
    limits = build_limits(args)
    check_processes(limits, args.processes)  # before any connection
    target = build_target(args)
    try:
        await target.start()
        vocab = args.vocab_size or (None if args.prompts else await target.vocab_size())
        spec = build_spec(args, vocab)
        mode = f"Poisson {args.rate} req/s" if limits.open_loop else f"concurrency {limits.concurrency}"
        print(
            f"benchmarking {target.description}: {mode}, "
            + (f"{limits.num_requests} requests" if limits.num_requests else f"{limits.duration_s} s")
            + f", {len(spec.adapter_ids)} adapter(s) ({spec.popularity}), base share {spec.base_share}",
            file=sys.stderr,
        )
        result = await run_benchmark(
            target,
            RequestStream(spec),
            limits,
            metrics_urls=args.metrics_url,
            slo_ttft_ms=args.slo_ttft_ms,
            progress_interval_s=args.progress_interval or None,
            processes=args.processes,
            make_target=functools.partial(build_target, args),
        )
    finally:
        await target.close()
    print(format_summary(result.summary))
    if args.result_json:
        doc: dict[str, object] = {
            "target": target.description,
            "config": {k: v for k, v in vars(args).items() if k not in ("api_key", "token")},
            "summary": result.summary,
        }
        if args.save_requests:
            doc["requests"] = records_as_dicts(result.records)
        Path(args.result_json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if result.summary["completed"] else 1


def bench_main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(list(argv or []))
    try:
        return asyncio.run(_bench(args))
    except TargetError as exc:
        print(f"loraserve bench: {exc}", file=sys.stderr)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"loraserve bench: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("loraserve bench: interrupted", file=sys.stderr)
        return 130
    return 1
