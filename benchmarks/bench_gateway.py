"""Gateway overhead: the same streaming workload sent straight to a worker over gRPC
(`GenerateStream`) and through the OpenAI-compatible gateway over HTTP (`/v1/completions`,
server-sent events). The worker (tiny random Llama, CPU) and the gateway run as their own
processes; the streams are split over --client-procs client processes (asyncio; a grpc.aio channel
or an httpx pool of pre-opened connections each) that start together.

Reported per path: time to first token and the gaps between a stream's tokens (p50 / p99 over
all gaps of all streams), wall time and token rate; the difference is what the gateway adds. The
gateway's CPU seconds (from /proc) over its phase give its cost per 1,000 streamed tokens/s and
the tokens/s one core of it carries.

    python benchmarks/bench_gateway.py [--streams 1000] [--max-tokens 16] [--result-md FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loraserve.clients.worker_client import AsyncWorkerClient  # noqa: E402
from loraserve.inference_worker.model.tiny import write_tiny_llama  # noqa: E402
from loraserve.serving.ports import listening_address  # noqa: E402

PROMPT = "Once upon a time there was"


@dataclass
class Stream:
    start: float
    stamps: list[float] = field(default_factory=list)  # arrival of each message carrying text
    tokens: int = 0  # from the final usage


@dataclass
class Phase:
    name: str
    streams: list[Stream]
    wall_s: float
    client_cpu_s: float  # the client processes' CPU over the phase (parsing the streams)
    worker_cpu_s: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.streams)

    def ttft_ms(self) -> list[float]:
        return [(s.stamps[0] - s.start) * 1e3 for s in self.streams if s.stamps]

    def gaps_ms(self) -> list[float]:
        """Between consecutive messages of a stream, per token (a message may carry several)."""
        out = []
        for s in self.streams:
            if len(s.stamps) > 1:
                per = (s.tokens - 1) / (len(s.stamps) - 1) if s.tokens > 1 else 1
                out += [(b - a) * 1e3 / per for a, b in zip(s.stamps, s.stamps[1:], strict=False)]
        return out


def bound_address(proc: subprocess.Popen) -> str:
    """host:port from the worker's "listening on" line: it binds port 0, so no port is picked
    beforehand for another process to take first."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if address := listening_address(line):
            return address
    raise RuntimeError(f"the worker exited with {proc.wait()} before listening")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def relay_buckets(url: str) -> dict[float, float]:
    """The gateway's delta-relay histogram: upper bound (s) -> cumulative count."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "loraserve_gateway_delta_relay_seconds"
    ]
    return {float(s.labels["le"]): s.value for s in family.samples if s.name.endswith("_bucket")}


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound of the bucket holding quantile q of what was observed between two reads."""
    counts = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    total = counts[float("inf")]
    return next(le for le, c in counts.items() if c >= q * total) if total else float("nan")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Part:
    """What one client process measured."""

    streams: list[Stream]
    t0: float  # perf_counter (CLOCK_MONOTONIC, one clock for all processes) when it started
    t1: float
    cpu_s: float


async def _grpc_part(address: str, n: int, max_tokens: int, barrier) -> Part:
    async with AsyncWorkerClient(address, timeout=600) as client:
        await client.info()  # the channel is connected

        async def one() -> Stream:
            s = Stream(time.perf_counter())
            async for d in client.generate_stream(PROMPT, max_tokens=max_tokens, ignore_eos=True):
                if d.text:
                    s.stamps.append(time.perf_counter())
                if d.usage is not None:
                    s.tokens = d.usage.completion_tokens
            return s

        await asyncio.to_thread(barrier.wait)
        t0, c0 = time.perf_counter(), time.process_time()
        streams = await asyncio.gather(*(one() for _ in range(n)))
        return Part(list(streams), t0, time.perf_counter(), time.process_time() - c0)


async def _http_part(url: str, model: str, n: int, max_tokens: int, barrier) -> Part:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:

        async def one() -> Stream:
            s = Stream(time.perf_counter())
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue  # separators, [DONE]
                    if '"usage":{' in line:  # the last chunk (include_usage)
                        s.tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                    elif '"text":""' not in line:
                        s.stamps.append(time.perf_counter())
            return s

        # open the connections first (as a long-running client holds them), so the streams reach
        # the gateway as fast as they reach the worker over the gRPC channel
        await asyncio.gather(*(http.get(url + "/health") for _ in range(n)))
        await asyncio.to_thread(barrier.wait)
        t0, c0 = time.perf_counter(), time.process_time()
        streams = await asyncio.gather(*(one() for _ in range(n)))
        return Part(list(streams), t0, time.perf_counter(), time.process_time() - c0)


def _run_part(kind: str, args: tuple) -> Part:
    return asyncio.run(_grpc_part(*args) if kind == "grpc" else _http_part(*args))


def run_phase(kind: str, target: tuple, n: int, max_tokens: int, procs: int) -> Phase:
    """n streams split over `procs` client processes that start together (one Python process
    cannot parse 1,000 HTTP streams as fast as the servers produce them)."""
    procs = max(1, min(procs, n))
    shares = [n // procs + (i < n % procs) for i in range(procs)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(procs, mp_context=ctx) as pool:
        barrier = manager.Barrier(procs)
        futures = [pool.submit(_run_part, kind, (*target, k, max_tokens, barrier)) for k in shares]
        parts = [f.result() for f in futures]
    name = "gRPC, straight to the worker" if kind == "grpc" else "HTTP + SSE through the gateway"
    streams = [s for p in parts for s in p.streams]
    wall = max(p.t1 for p in parts) - min(p.t0 for p in parts)
    return Phase(name, streams, wall, sum(p.cpu_s for p in parts))


def start(argv: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "loraserve", *argv], **kw)


def wait_for_worker(address: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {proc.returncode}")
        try:
            with grpc.insecure_channel(address) as ch:
                grpc.channel_ready_future(ch).result(timeout=1)
            return
        except grpc.FutureTimeoutError:
            if time.monotonic() > deadline:
                raise


def machine() -> str:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    return (
        f"{os.cpu_count()} CPUs ({cpu}), load average {os.getloadavg()[0]:.1f} at the start, "
        f"Python {platform.python_version()}, grpcio {grpc.__version__}"
    )


def report(
    phases: list[Phase],
    gateway_cpu_s: float,
    relay: tuple[float, float],
    args: argparse.Namespace,
    setup: str,
) -> str:
    rows = []
    for p in phases:
        rows.append(
            f"| {p.name} | {len(p.streams)} | {p.tokens:,} | {p.wall_s:.2f} s | {p.tokens / p.wall_s:,.0f} | "
            f"{pct(p.ttft_ms(), 0.5):.1f} / {pct(p.ttft_ms(), 0.99):.1f} | "
            f"{pct(p.gaps_ms(), 0.5):.2f} / {pct(p.gaps_ms(), 0.99):.2f} | {p.client_cpu_s:.2f} s | {p.worker_cpu_s:.2f} s |"
        )
    grpc_p, http_p = phases
    added50 = pct(http_p.gaps_ms(), 0.5) - pct(grpc_p.gaps_ms(), 0.5)
    added99 = pct(http_p.gaps_ms(), 0.99) - pct(grpc_p.gaps_ms(), 0.99)
    rate = http_p.tokens / http_p.wall_s
    cores = gateway_cpu_s / http_p.wall_s
    return "\n".join(
        [
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {args.streams} concurrent streams of "
            f"{args.max_tokens} tokens, {args.client_procs} client processes ({setup})",
            "",
            "| path | streams | tokens | wall | tokens/s | TTFT p50 / p99 ms | per-token gap p50 / p99 ms "
            "| client CPU | worker CPU |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
            f"- per-token gap through the gateway minus straight to the worker (client side): "
            f"p50 {added50:+.2f} ms, p99 {added99:+.2f} ms",
            f"- the gateway's own relay time per delta (worker delta in -> SSE bytes handed to the "
            f"connection, its histogram's bucket bounds): p50 <= {relay[0] * 1e3:g} ms, "
            f"p99 <= {relay[1] * 1e3:g} ms",
            f"- gateway CPU: {gateway_cpu_s:.2f} s over {http_p.wall_s:.2f} s = {cores:.2f} cores for "
            f"{rate:,.0f} tokens/s, i.e. {cores / (rate / 1000):.3f} cores per 1,000 streamed tokens/s; "
            f"one core of it carries {http_p.tokens / gateway_cpu_s:,.0f} tokens/s",
        ]
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=1000, help="concurrent streams per path")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per stream (ignore_eos)")
    p.add_argument("--client-procs", type=int, default=4, help="client processes sharing the streams")
    p.add_argument("--result-md", help="append the Markdown result here")
    args = p.parse_args()
    setup = machine()
    print(setup, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_llama(Path(tmp) / "model")
        seqs = max(args.streams, 8)
        worker = start(
            ["worker", "--model", str(model), "--port", "0", "--device", "cpu"]
            + ["--dtype", "float32", "--max-num-seqs", str(seqs), "--max-queue-size", str(2 * seqs)]
            + ["--max-num-batched-tokens", str(max(4096, seqs)), "--max-model-len", "256"]
            + ["--num-kv-blocks", str(3 * seqs + 16), "--no-cuda-graphs", "--log-level", "WARNING"],
            stdout=subprocess.PIPE,
            text=True,
        )
        gateway = None
        try:
            worker_address = bound_address(worker)
            wait_for_worker(worker_address, worker)
            gateway = start(
                ["openai", "--port", "0", "--worker", worker_address, "--log-level", "WARNING"],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert gateway.stdout is not None
            line = gateway.stdout.readline()  # "OpenAI-compatible API on http://127.0.0.1:PORT/v1 (...)"
            url = line.split(" on ", 1)[1].split("/v1", 1)[0]
            model_name = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
            # warm-up of both paths (connections, first compilations of the worker's shapes)
            run_phase("grpc", (worker_address,), 16, 4, args.client_procs)
            run_phase("http", (url, model_name), 16, 4, args.client_procs)
            w0 = cpu_seconds(worker.pid)
            grpc_result = run_phase(
                "grpc", (worker_address,), args.streams, args.max_tokens, args.client_procs
            )
            grpc_result.worker_cpu_s = cpu_seconds(worker.pid) - w0
            print(f"gRPC done in {grpc_result.wall_s:.1f} s", flush=True)
            cpu0, w0 = cpu_seconds(gateway.pid), cpu_seconds(worker.pid)
            before = relay_buckets(url)
            http_result = run_phase(
                "http", (url, model_name), args.streams, args.max_tokens, args.client_procs
            )
            gateway_cpu = cpu_seconds(gateway.pid) - cpu0
            after = relay_buckets(url)
            relay = (bucket_quantile(before, after, 0.5), bucket_quantile(before, after, 0.99))
            http_result.worker_cpu_s = cpu_seconds(worker.pid) - w0
        finally:
            for proc in (gateway, worker):
                if proc is not None:
                    proc.terminate()
                    proc.wait(30)
    out = report([grpc_result, http_result], gateway_cpu, relay, args, setup)
    print(out)
    if args.result_md:
        with open(args.result_md, "a") as f:
            f.write("\n" + out + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
