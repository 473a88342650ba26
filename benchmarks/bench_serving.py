"""Many adapters under live traffic, measured through the services: a store process and worker
processes over gRPC, driven by `loraserve bench`'s load generator.

1. Data: a random Llama checkpoint (`--shape 1b`: Llama-3.2-1B's shape, bf16) and `--num-adapters`
   distinct PEFT adapters (ranks 8 and 16 mixed, all seven modules) written to `--workdir`,
   registered with a store whose cache, like the worker's CPU tier and GPU slots, is smaller than
   the adapter set, so every tier is exercised.
2. For each N of `--ns` (Zipf popularity over N adapters, same lengths): a warm-up, throughput at
   saturation (a closed loop of 2 x max_num_seqs requests in flight), then Poisson arrivals at 50%
   and 80% of that throughput: TTFT percentiles, overall and by the tier each request's adapter was
   in when it arrived (gpu / cpu / store, as the worker reports it per request).
3. Popularity prefetch (`--prefetch-duration`): two workers sharing Redis. A warm phase through
   the router over both (`--prefetch-warmup`, "warm"), so the fleet is measured in steady state;
   then Poisson traffic through the router ("both"); then the first goes away (a restart, a
   scale-in) and the second serves alone ("replaced"). Each time, the share of requests whose
   adapter was resident (GPU or CPU tier) on arrival, with prefetch off and on.

    python benchmarks/bench_serving.py --shape 1b --num-adapters 1000 --ns 5,100,1000 --json out.json
    python benchmarks/bench_serving.py --shape tiny --device cpu --num-adapters 24 --ns 2,24 \\
        --max-loras 2 --max-cpu-loras 8 --store-cache 4 --duration 2 --json smoke.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import io
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_args import parser
from serving_fleet import Fleet, Service, WorkerOptions, register_all, write_adapters, write_model
from serving_probes import EngineSampler, ProcessCpu, enter_all, holdings, host_cpu, py_spy
from serving_report import coverage, device_name, line_for, resident_share, still_warming, store_share

from loraserve.clients.bench.runner import RunLimits, run_benchmark
from loraserve.clients.bench.targets import RouterTarget, Sampling, Target, WorkerTarget
from loraserve.clients.bench.workload import RequestStream, WorkloadSpec

S_LORA_RATIO = 7.61 / 8.05  # S-LoRA's 1,000 / 5 adapters throughput (0.945)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.vocab = 0
        self.store_metrics = ""  # the store's metrics address, read with each run's workers'
        self.results: dict[str, object] = {
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "device": device_name(args.device),
            "host_cpu": host_cpu(),  # runs on different hosts differ: compare within one run
            # the run's settings, without this machine's paths and addresses
            "config": {
                **{
                    k: v
                    for k, v in vars(args).items()
                    if k not in ("json", "workdir", "redis_server", "redis_url", "profile", "variant_tree")
                },
                "variant_trees": [name for name, _ in args.variant_tree],  # (their folders left out)
            },
            "s_lora_ratio": round(S_LORA_RATIO, 4),
            "n": {},
        }

    def save(self) -> None:
        if self.args.json:
            Path(self.args.json).write_text(json.dumps(self.results, indent=2) + "\n")

    def profiled(
        self, worker: Service, name: str, seconds: float, on: bool = True
    ) -> contextlib.AbstractContextManager[None]:
        """With --profile DIR (and `on`): py-spy samples the worker for `seconds` (DIR/name.txt;
        with --profile-gil also DIR/name.gil.txt, the thread holding the interpreter lock)."""
        a = self.args
        if not (a.profile and on):
            return contextlib.nullcontext()
        return py_spy(worker.process.pid, a.profile / name, seconds, gil=a.profile_gil)

    def spec(self, ids: Sequence[str], rate: float | None, seed: int) -> WorkloadSpec:
        a = self.args
        return WorkloadSpec(
            adapter_ids=tuple(ids),
            popularity="zipf",
            zipf_exponent=a.zipf,
            prompt_len=a.prompt_len,
            output_len=a.output_len,
            vocab_size=self.vocab,
            rate=rate,
            seed=seed,
        )

    def load(
        self,
        make_target: Callable[[], Target],
        ids: Sequence[str],
        *,
        rate: float | None,
        duration: float,
        seed: int,
        metrics: Sequence[str] = (),
        processes: int | None = None,
        on_start: Callable[[], None] | None = None,
    ) -> dict:
        """One run: a closed loop of 2 x max_num_seqs in flight (rate None) or Poisson arrivals,
        from `processes` generator processes (default --gen-processes)."""
        processes = self.args.gen_processes if processes is None else processes
        in_flight = 2 * self.args.max_num_seqs
        limits = (
            RunLimits(duration_s=duration, concurrency=in_flight, open_loop=False)
            if rate is None
            else RunLimits(duration_s=duration)
        )
        stream = RequestStream(self.spec(ids, rate, seed))
        if metrics and self.store_metrics:  # the store's too: where its fetches' payloads came from
            metrics = [*metrics, self.store_metrics]

        async def go() -> dict:
            # from this process: a target whose channels belong to this run's event loop; from
            # several, each makes its own
            target = make_target() if processes == 1 else None
            if target is not None:
                await target.start()
            try:
                got = await run_benchmark(
                    target,
                    stream,
                    limits,
                    metrics_urls=metrics,
                    progress_interval_s=None,
                    progress_out=io.StringIO(),
                    processes=processes,
                    make_target=make_target,
                    on_start=on_start,
                )
            finally:
                if target is not None:
                    await target.close()
            return got.summary

        summary = asyncio.run(go())
        summary["resident_share"] = resident_share(summary)
        summary["offered_rate"] = rate
        return summary

    # ------------------------------------------------------------------ the N sweep
    def settle(
        self, target: Callable[[], Target], ids: Sequence[str], n: int, warmup: dict, metrics: str
    ) -> list[dict]:
        """With --settle S: more warm-up periods of S seconds while the share of requests whose
        adapter came from the store keeps falling (serving_report.still_warming), up to
        --max-warmup seconds in all; each period's store share and throughput."""
        a = self.args
        periods: list[dict] = []
        before, now = None, store_share(warmup)
        spent = float(warmup.get("duration_s") or 0.0)
        while a.settle > 0 and spent + a.settle <= a.max_warmup and still_warming(before, now):
            got = self.load(
                target, ids, rate=None, duration=a.settle, seed=n + 1000 * (len(periods) + 1),
                metrics=[metrics],
            )  # fmt: skip
            before, now = now, store_share(got)
            spent += float(got.get("duration_s") or a.settle)
            periods.append({"store_share": now, "request_throughput": got["request_throughput"]})
        return periods

    def sweep(self, worker: Service, names: list[str], variant: str = "") -> None:
        """The N sweep on `worker`; a `variant` (a worker started with other flags) is reported
        under results["variants"][variant] instead of results["n"]."""
        a = self.args
        results: dict = self.results
        out: dict = results.setdefault("variants", {}).setdefault(variant, {"n": {}}) if variant else results
        table: dict = out["n"]
        for i, n in enumerate(a.ns):
            ids = names[:n]
            row: dict[str, object] = {}

            # (a partial, not a closure: each generator process builds its own from it)
            target = functools.partial(
                WorkerTarget, worker.address, Sampling(timeout_s=600), connections=a.connections
            )

            # the first warm-up is longer: the worker's kernels compile for the shapes they meet
            warm = a.first_warmup if i == 0 else a.warmup
            # profiles and the engine sampler start with the run, after the generator's processes
            with contextlib.ExitStack() as stack:
                profile = self.profiled(worker, f"n{n}-warmup", warm, on=i == 0 and not variant)
                row["warmup"] = self.load(
                    target, ids, rate=None, duration=warm, seed=n, metrics=[worker.metrics_address],
                    on_start=functools.partial(enter_all, stack, (profile,)),
                )  # fmt: skip
            row["settle"] = self.settle(target, ids, n, row["warmup"], worker.metrics_address)
            engine = EngineSampler(worker.address, window_s=a.duration)
            cpu = ProcessCpu(worker.process.pid, window_s=a.duration)
            with contextlib.ExitStack() as stack:
                contexts = (
                    self.profiled(worker, f"n{n}-saturation", a.duration, on=not variant),
                    engine,
                    cpu,
                )
                sat = self.load(
                    target, ids, rate=None, duration=a.duration, seed=10 + n, metrics=[worker.metrics_address],
                    on_start=functools.partial(enter_all, stack, contexts),
                )  # fmt: skip
            sat["engine"] = engine.summary()
            sat["cpu"] = cpu.summary()
            row["saturation"] = sat
            throughput = float(sat["request_throughput"])
            for share in (0.5, 0.8):
                got = self.load(
                    target, ids, rate=share * throughput, duration=a.duration, seed=20 + n,
                    metrics=[worker.metrics_address],
                )  # fmt: skip
                row[f"load_{int(share * 100)}"] = got
            table[str(n)] = row
            self.save()
            print(f"{variant or 'default'}: {line_for(n, row)}", flush=True)
        lo, hi = str(min(a.ns)), str(max(a.ns))
        if lo != hi:
            base = table[lo]["saturation"]["request_throughput"]
            top = table[hi]["saturation"]["request_throughput"]
            out["throughput_ratio"] = {
                "n_high": int(hi),
                "n_low": int(lo),
                "ratio": round(top / base, 4),
            }
        self.save()

    # ------------------------------------------------------------------ popularity prefetch
    def prefetch(self, fleet: Fleet, model_dir: Path, store: str, names: list[str], redis_url: str) -> None:
        """Two workers sharing Redis, prefetch off and on. A warm phase through the router over
        both (a closed loop for `--prefetch-warmup` s: the decayed counts settle and the tiers
        fill), then the measured phase (Poisson, "both"), then the first worker is stopped and
        the router sends everything to the second ("replaced"). The resident share of each."""
        a = self.args
        ids = names[: max(a.ns)]
        out: dict[str, object] = {}
        variants = {v: (a.prefetch if v == "on" else 0) for v in a.prefetch_variants}
        opts = {
            v: WorkerOptions(
                **{**self.worker_options().__dict__, "prefetch": p, "kv_cache_mb": a.kv_cache_mb // 2}
            )
            for v, p in variants.items()
        }
        started: dict[str, tuple[Service, Service]] = {}
        for v in variants:  # all four start at once; each pair has its own Redis key prefix
            extra = ["--redis-prefix", f"{a.redis_prefix}{v}:"]
            first, second = (
                fleet.start_worker(
                    f"{v}-{k}",
                    model_dir,
                    store,
                    WorkerOptions(**{**opts[v].__dict__, "extra": extra}),
                    redis_url=redis_url,
                    wait=False,
                )  # fmt: skip
                for k in ("first", "second")
            )
            started[v] = (first, second)
        for pair in started.values():
            for svc in pair:
                fleet.wait_worker(svc)
        rate = a.prefetch_rate or 0.5 * self._saturation(ids)
        for v, (first, second) in started.items():
            both = [first.address, second.address]
            metrics = [first.metrics_address, second.metrics_address]
            phases: dict[str, dict] = {}
            # one generator process: one router, whose residency and load are its own choices
            routed = functools.partial(
                self.load,
                functools.partial(RouterTarget, both, Sampling(timeout_s=600), connections=a.connections),
                ids,
                processes=1,
            )
            phases["warm"] = routed(rate=None, duration=a.prefetch_warmup, seed=7, metrics=metrics)
            held_before = holdings(both)
            phases["both"] = routed(rate=rate, duration=a.prefetch_duration, seed=8, metrics=metrics)
            phases["both"]["holdings"] = {
                "before": coverage(held_before, ids, a.zipf),
                "after": coverage(holdings(both), ids, a.zipf),
            }
            # then the first worker goes away (a restart, a scale-in): the second serves alone
            fleet.stop(first)
            phases["replaced"] = routed(
                rate=rate, duration=a.prefetch_duration, seed=9, metrics=[second.metrics_address]
            )
            out[v] = phases
            shares = ", ".join(f"{phase} {got['resident_share']}" for phase, got in phases.items())
            held = {
                w: {k: v for k, v in c.items() if k != "ranks_held_twice"}
                for w, c in phases["both"]["holdings"].items()
            }
            print(f"prefetch {v}: resident share {shares}; holdings {held}", flush=True)
            fleet.stop(second)
            self.results["prefetch"] = out
            self.save()

    def _saturation(self, ids: Sequence[str]) -> float:
        table: dict = self.results["n"]  # type: ignore[assignment]
        row = table.get(str(len(ids))) or {}
        return float(row.get("saturation", {}).get("request_throughput", 0.0)) or 1.0

    def worker_options(self) -> WorkerOptions:
        a = self.args
        return WorkerOptions(
            device=a.device,
            dtype=a.dtype,
            max_loras=a.max_loras,
            max_cpu_loras=a.max_cpu_loras,
            max_lora_rank=16,
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens,
            max_model_len=a.prompt_len[1] + a.output_len[1] + 16,
            kv_cache_mb=a.kv_cache_mb,
            lookahead=a.lookahead,
            prefetch=0,
            cuda_graphs=a.device != "cpu",
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = parser(__doc__.split("\n\n")[0]).parse_args(argv)
    if max(args.ns) > args.num_adapters:
        raise SystemExit(f"--ns goes up to {max(args.ns)} but only {args.num_adapters} adapters are made")
    args.workdir.mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    t0 = time.monotonic()
    model_dir = write_model(args.workdir / f"model-{args.shape}", args.shape)
    adapter_root = args.workdir / f"adapters-{args.shape}"
    names = write_adapters(adapter_root, model_dir, args.num_adapters, args.processes)
    print(f"data ready in {time.monotonic() - t0:.1f} s", flush=True)
    fleet = Fleet(args.workdir)
    try:
        store = fleet.start_store(
            model_dir,
            adapter_root,
            cache_adapters=args.store_cache,
            dtype=args.dtype,
            handover_dir=args.store_handover_dir,
            handover_max_bytes=args.store_handover_max_bytes,
        )
        bench.store_metrics = store.metrics_address
        t1 = time.monotonic()
        register_all(store.address, adapter_root, names)
        print(f"{len(names)} adapters registered in {time.monotonic() - t1:.1f} s", flush=True)
        bench.vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        if args.sweep:
            worker = fleet.start_worker("worker", model_dir, store.address, bench.worker_options())
            bench.sweep(worker, names)
            fleet.stop(worker)
        for name, flags in args.variant:
            opts = bench.worker_options()
            opts.extra = [*opts.extra, *flags.split()]
            worker = fleet.start_worker(f"worker-{name}", model_dir, store.address, opts)
            bench.sweep(worker, names, variant=name)
            fleet.stop(worker)
        for name, tree in args.variant_tree:
            opts = bench.worker_options()
            opts.code_tree = tree
            worker = fleet.start_worker(f"worker-{name}", model_dir, store.address, opts)
            bench.sweep(worker, names, variant=name)
            fleet.stop(worker)
        if args.prefetch_duration > 0:
            redis_url = args.redis_url or fleet.start_redis(args.redis_server)[1]
            bench.prefetch(fleet, model_dir, store.address, names, redis_url)
    finally:
        fleet.close()
        bench.results["wall_s"] = round(time.monotonic() - t0, 1)
        bench.save()
    ratio = bench.results.get("throughput_ratio")
    if ratio:
        print(
            f"throughput N={ratio['n_high']} / N={ratio['n_low']}: {ratio['ratio']} (S-LoRA {S_LORA_RATIO:.3f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
