"""How fast `loraserve bench` can drive a server from one CPU core: the request rate it sustains.

A token server in its own process (gRPC InferenceWorker.GenerateStream, a token every --tpot-ms,
streamed as a decoding worker streams them; no model) stands in for a worker that is never the
bottleneck. With --stream-interval K the generator asks for K tokens a message and the server
answers as the worker does: the first token alone and at once, then a message every K tokens
(K x tpot apart), what is left with the last. The generator runs pinned to one core at rising
Poisson rates for --duration seconds each; a rate is sustained when the completion rate is >= 95%
of it and the p99 lag between a request's planned and actual send time stays under 50 ms; each
rate's row also gives both processes' CPU shares (a token server near 1 was the limit itself). The
serving benchmark compares the highest sustained rate with the workers' measured saturation rate
(the aim: >= 5x).

    python benchmarks/bench_generator.py [--rates 50,100,200,400,800] [--output-len 128]
        [--stream-interval 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serving_probes import cpu_model, cpu_s  # noqa: E402

from loraserve.clients.bench.collector import rare_collections  # noqa: E402
from loraserve.clients.bench.results import summarize  # noqa: E402
from loraserve.clients.bench.runner import RunLimits, Runner  # noqa: E402
from loraserve.clients.bench.targets import Sampling, WorkerTarget  # noqa: E402
from loraserve.clients.bench.workload import RequestStream, WorkloadSpec, adapter_ids  # noqa: E402
from loraserve.clients.cli_options import stream_interval  # noqa: E402
from loraserve.contract.streaming import message_ends  # noqa: E402

SUSTAINED_SHARE = 0.95
MAX_SEND_LAG_MS = 50.0


def _token_server(port_out, tpot_s: float, cores: set[int]) -> None:
    """Serve GenerateStream: max_tokens tokens, tpot_s apart, in the messages `message_ends` says."""
    import grpc

    from loraserve.v1 import worker_pb2, worker_pb2_grpc

    if cores:
        os.sched_setaffinity(0, cores)

    class TokenServer(worker_pb2_grpc.InferenceWorkerServicer):
        async def GenerateStream(self, request, context):
            n = request.sampling.max_tokens or 16
            start = time.perf_counter()
            sent = 0
            for end in message_ends(n, request.stream_interval):
                if sent:  # each message leaves as its last token is made
                    await asyncio.sleep((end - sent) * tpot_s)
                msg = worker_pb2.GenerateStreamResponse(
                    request_id=request.request_id, token_ids=[i % 100 for i in range(sent, end)]
                )
                sent = end
                if end == n:
                    msg.finish_reason = worker_pb2.FINISH_REASON_LENGTH
                    ms = (time.perf_counter() - start) * 1e3
                    msg.usage.CopyFrom(
                        worker_pb2.Usage(
                            prompt_tokens=len(request.prompt_token_ids),
                            completion_tokens=n,
                            total_time_ms=ms,
                        )
                    )
                yield msg

        async def GetWorkerInfo(self, request, context):
            return worker_pb2.WorkerInfo(vocab_size=32000)

    async def serve() -> None:
        server = grpc.aio.server()
        worker_pb2_grpc.add_InferenceWorkerServicer_to_server(TokenServer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_out.put(port)
        await server.wait_for_termination()

    asyncio.run(serve())


def _spec(rate: float, args: argparse.Namespace) -> WorkloadSpec:
    """The measured request stream at `rate`: Zipf over the adapters, fixed lengths, seeded."""
    return WorkloadSpec(
        adapter_ids=adapter_ids(args.num_adapters),
        popularity="zipf",
        prompt_len=(args.prompt_len, args.prompt_len),
        output_len=(args.output_len, args.output_len),
        rate=rate,
        seed=1,
    )


async def _run_rate(
    address: str, rate: float, args: argparse.Namespace, server_pid: int
) -> dict[str, object]:
    """One rate; `server_cpu_share` says whether the token server kept up (near 1: its core was
    the limit, not the generator's)."""
    target = WorkerTarget(address, Sampling(stream_interval=args.stream_interval))
    await target.start()
    spec = _spec(rate, args)
    runner = Runner(
        target, RunLimits(None, args.duration), progress_interval_s=None, progress_out=io.StringIO()
    )
    cpu0, server0 = time.process_time(), cpu_s(server_pid)
    result = await runner.run(RequestStream(spec))
    cpu, server1 = time.process_time() - cpu0, cpu_s(server_pid)
    span = max(result.duration_s, 1e-9)
    await target.close()
    s = summarize(result.records, duration_s=result.duration_s)
    lag = s["send_lag_ms"]
    assert isinstance(lag, dict)
    completed = s["completed"]
    assert isinstance(completed, int)
    achieved = completed / args.duration
    return {
        "offered_rate": rate,
        "completed": completed,
        "failed": s["failed"],
        "achieved_rate": round(achieved, 2),
        "messages_per_request": s["messages_per_request"],
        "messages_per_s": round(sum(r.messages for r in result.records if r.ok) / args.duration, 1),
        "send_lag_p99_ms": lag["p99"],
        "ttft_p50_ms": s["ttft_ms"]["p50"],  # type: ignore[index]
        "cpu_share": round(cpu / span, 3),
        "server_cpu_share": round((server1 - server0) / span, 3),
        "sustained": bool(
            s["failed"] == 0 and achieved >= SUSTAINED_SHARE * rate and (lag["p99"] or 0) <= MAX_SEND_LAG_MS
        ),
    }


async def _bare_rate(address: str, rate: float, args: argparse.Namespace) -> dict[str, object]:
    """The transport's floor: the same request stream sent by a bare loop (a gRPC asyncio stub,
    each stream read and dropped; nothing timed, nothing recorded), its CPU share at `rate`."""
    import grpc

    from loraserve.clients.worker_client import build_request
    from loraserve.v1 import worker_pb2_grpc

    spec = _spec(rate, args)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.InferenceWorkerStub(channel)

        async def one(request) -> None:
            prompt, adapter, n = request.prompt, request.adapter_id, request.max_tokens
            k = args.stream_interval
            async for _ in stub.GenerateStream(
                build_request(prompt, adapter_id=adapter, max_tokens=n, stream_interval=k)
            ):
                pass

        tasks = []
        t0, cpu0 = time.perf_counter(), time.process_time()
        for request in RequestStream(spec):
            if request.arrival_s >= args.duration:
                break
            delay = request.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        await asyncio.gather(*tasks)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"offered_rate": rate, "requests": len(tasks), "cpu_share": round(cpu / wall, 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="50,100,200,400,800", help="offered Poisson rates, req/s")
    p.add_argument("--duration", type=float, default=8.0, help="seconds per rate")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--num-adapters", type=int, default=1000)
    p.add_argument("--tpot-ms", type=float, default=20.0, help="token server's gap between tokens")
    p.add_argument(
        "--stream-interval",
        type=stream_interval,
        default=0,
        help="tokens a message the generator asks for (loraserve bench --stream-interval); 0 = one",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="then send the highest sustained rate's stream again through a bare gRPC read loop: "
        "the share of the core it takes, against the generator's at that rate",
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    client_core, server_cores = cores[0], set(cores[1:]) or set(cores)
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    server = ctx.Process(target=_token_server, args=(port_q, args.tpot_ms / 1e3, server_cores), daemon=True)
    server.start()
    floor: dict[str, object] | None = None
    try:
        address = f"127.0.0.1:{port_q.get(timeout=60)}"
        os.sched_setaffinity(0, {client_core})
        rows = []
        for rate in (float(r) for r in args.rates.split(",")):
            assert server.pid is not None
            row = asyncio.run(_run_rate(address, rate, args, server.pid))
            rows.append(row)
            print(json.dumps(row), flush=True)
            if not row["sustained"]:
                break
        best = max((r for r in rows if r["sustained"]), key=lambda r: r["achieved_rate"], default=None)
        if args.floor and best is not None:
            rate = float(best["offered_rate"])  # type: ignore[arg-type]
            with rare_collections():  # (as the generator's runs hold the collector)
                floor = asyncio.run(_bare_rate(address, rate, args))
            floor["generator_cpu_share"] = best["cpu_share"]  # the sweep's row at that rate
            print(json.dumps({"floor": floor}), flush=True)
    finally:
        server.terminate()
        server.join(5)
    sustained = max((r["achieved_rate"] for r in rows if r["sustained"]), default=0.0)
    per_request = len(message_ends(args.output_len, args.stream_interval))
    out = {
        "client_core": client_core,
        "cpu": cpu_model(),
        "output_len": args.output_len,
        "stream_interval": args.stream_interval,
        "messages_per_request": per_request,
        "prompt_len": args.prompt_len,
        "tpot_ms": args.tpot_ms,
        "max_sustained_rate": sustained,
        "rows": rows,
    }
    if floor is not None:
        out["transport_floor"] = floor
    print(
        f"\ngenerator on one core ({out['cpu']}, core {client_core}) sustains {sustained} req/s at "
        f"{args.output_len} output tokens, {per_request} messages a request "
        f"({sustained * per_request:.0f} streamed messages/s)"
    )
    if floor is not None:
        print(
            f"at {floor['offered_rate']} req/s the generator keeps its core {floor['generator_cpu_share']} busy, "
            f"a bare gRPC read loop of the same streams {floor['cpu_share']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
