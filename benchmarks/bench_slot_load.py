"""What one adapter's copy into a GPU slot costs the engine's step thread: `LoRASlots.load` of a
pinned payload (the serving benchmark's 1B shape, rank 16, all modules), host wall time per call,
alone and beside threads that keep the interpreter lock busy as a serving worker's do
(bench_fetch_contention.Busy), and the device time of the copies it queues (queued back to back
behind a held stream, so the host's pace does not enter it). Also the event loop's share: `LoRASlots.check` (the copy plan, built once per fetched payload).

Then what a load costs the steps around it: stand-in decode steps (bandwidth-bound GEMMs of about
--step-ms each) queued as the engine queues them, the host one step ahead, with a load before
every --load-every-th step, the upload on the slots' copy stream or in line on the steps' stream,
and without loads; the three interleaved in each round.

    python benchmarks/bench_slot_load.py [--loads 200] [--json F]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_fetch_contention import Busy  # noqa: E402
from serving_fleet import SHAPES  # noqa: E402

from loraserve.contract.payload import PayloadTensor  # noqa: E402
from loraserve.inference_worker.lora.payload import AdapterPayload  # noqa: E402
from loraserve.inference_worker.lora.slots import LoRASlots  # noqa: E402
from loraserve.inference_worker.model.tiny import llama_config  # noqa: E402


def payload_for(slots: LoRASlots, name: str, rank: int, pin: bool) -> AdapterPayload:
    """A payload in the store's layout (every group of every layer, A then B, 64-byte aligned)."""
    tensors, offset = [], 0
    for layer in range(slots.num_layers):
        for group in ("qkv", "o", "gate_up", "down"):
            n_slices, n_in, n_out = (
                len(slots.out_sizes[group]),
                slots.payload_in[group],
                slots.payload_out[group],
            )
            for which, shape in (("lora_a", (n_slices, rank, n_in)), ("lora_b", (n_out, rank))):
                nbytes = 2 * int(torch.tensor(shape).prod())
                tensors.append(
                    PayloadTensor(f"layers.{layer}.{group}.{which}", shape, "bfloat16", offset, nbytes)
                )
                offset += -(-nbytes // 64) * 64
    data = torch.randint(0, 255, (offset,), dtype=torch.uint8)
    return AdapterPayload(name, "0" * 64, rank, data.pin_memory() if pin else data, tensors)


def percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "median": round(statistics.median(xs), 4),
        "p90": round(xs[int(0.9 * (len(xs) - 1))], 4),
        "mean": round(statistics.fmean(xs), 4),
    }


class StandInStep:
    """Bandwidth-bound GEMMs (64 rows against an 8B-sized gate | up weight) taking about
    `target_ms` a step on this device."""

    def __init__(self, target_ms: float) -> None:
        self.x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
        self.w = torch.randn(4096, 28672, device="cuda", dtype=torch.bfloat16)
        self.repeats = 1
        for _ in range(3):
            self()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            self()
        end.record()
        end.synchronize()
        self.repeats = max(1, round(target_ms / (start.elapsed_time(end) / 20)))

    def __call__(self) -> None:
        for _ in range(self.repeats):
            torch.mm(self.x, self.w)


def steps_with_loads(
    slots: LoRASlots | None, payloads: list[AdapterPayload], step: StandInStep, steps: int, every: int
) -> float:
    """ms per step of `steps` steps with a load into the next slot before every `every`-th (none
    when `slots` is None); the host queues step i + 1 while step i runs, as the engine does."""
    done = [torch.cuda.Event() for _ in range(steps)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        if slots is not None and i % every == 0:
            slots.load((i // every) % slots.max_loras, payloads[(i // every) % len(payloads)])
        step()
        done[i].record()
        if i:
            done[i - 1].synchronize()
    done[-1].synchronize()
    return (time.perf_counter() - t0) * 1e3 / steps


def beside_steps(args: argparse.Namespace, inline: LoRASlots, copying: LoRASlots, payloads) -> dict:
    step = StandInStep(args.step_ms)
    runs: dict[str, list[float]] = {"no loads": [], "upload in line": [], "upload on the copy stream": []}
    for slots in (inline, copying):
        steps_with_loads(slots, payloads, step, 2 * args.load_every * len(payloads), args.load_every)
    for _ in range(args.rounds):
        runs["no loads"].append(steps_with_loads(None, payloads, step, args.steps, args.load_every))
        runs["upload in line"].append(steps_with_loads(inline, payloads, step, args.steps, args.load_every))
        runs["upload on the copy stream"].append(
            steps_with_loads(copying, payloads, step, args.steps, args.load_every)
        )
    base = statistics.median(runs["no loads"])
    return {
        "step_repeats": step.repeats,
        "load_every": args.load_every,
        "steps": args.steps,
        "rounds": {k: [round(v, 4) for v in vs] for k, vs in runs.items()},
        "ms_per_step": {k: round(statistics.median(vs), 4) for k, vs in runs.items()},
        # what each load added to the steps, ms (median step time over no loads, times the spacing)
        "ms_added_per_load": {
            k: round((statistics.median(vs) - base) * args.load_every, 4)
            for k, vs in runs.items()
            if vs is not runs["no loads"]
        },
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--loads", type=int, default=200)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=64)
    p.add_argument("--switch-interval-ms", type=float, default=0.5, help="as the worker sets it")
    p.add_argument("--json", default=None)
    p.add_argument("--step-ms", type=float, default=3.0, help="stand-in step's device time")
    p.add_argument("--load-every", type=int, default=3, help="a load before every n-th step")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    shape = SHAPES["1b"]
    config = llama_config(shape, shape.vocab_size, bos_id=1, eos_id=2)
    slots = LoRASlots(config, args.max_loras, args.rank, torch.bfloat16, "cuda")
    inline = LoRASlots(config, args.max_loras, args.rank, torch.bfloat16, "cuda", copy_stream=False)
    payloads = [payload_for(slots, f"a{i}", args.rank, pin=True) for i in range(16)]
    rows: dict[str, dict] = {}

    # the event loop's part: a fresh payload's copy plan (cached on it afterwards)
    plan_ms = []
    for i in range(args.loads):
        fresh = AdapterPayload(f"p{i}", "0" * 64, args.rank, payloads[0].data, payloads[0].tensors)
        t0 = time.perf_counter()
        slots.check(fresh)
        plan_ms.append((time.perf_counter() - t0) * 1e3)
    rows["check (copy plan)"] = percentiles(plan_ms)

    for pl in payloads:
        slots.load(0, pl)  # plans, views and the staging buffers made once
        inline.load(0, pl)
    torch.cuda.synchronize()
    for busy in (False, True):
        for how, target in (("", slots), (" (upload in line)", inline)):
            host_ms = []
            with Busy() if busy else contextlib.nullcontext():
                for i in range(args.loads):
                    t0 = time.perf_counter()
                    target.load(i % args.max_loras, payloads[i % len(payloads)])
                    host_ms.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            rows[f"load{how}, {'busy interpreter' if busy else 'alone'}"] = percentiles(host_ms)
    # The device's part: loads queued back to back, the stream held until all are queued, so the
    # span between the events is the copies alone, not the host's pace (uploads in line on the
    # stream, so the span holds them too).
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e9))  # ~1 s of spinning while the loads queue behind it
    start.record()
    for i in range(args.loads):
        inline.load(i % args.max_loras, payloads[i % len(payloads)])
    end.record()
    end.synchronize()
    device_ms = round(start.elapsed_time(end) / args.loads, 4)
    nbytes = payloads[0].nbytes
    steps = beside_steps(args, inline, slots, payloads)
    out = {
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "payload_bytes": nbytes,
        "rank": args.rank,
        "rows": rows,
        "device_ms_per_load": device_ms,
        "beside_steps": steps,
    }
    print(f"\none {nbytes / 1e6:.1f} MB payload (1b shape, rank {args.rank}), {out['device']}")
    print("| host ms per call | median | p90 | mean |")
    print("| --- | ---: | ---: | ---: |")
    for name, r in rows.items():
        print(f"| {name} | {r['median']} | {r['p90']} | {r['mean']} |")
    print(f"device: {device_ms} ms per load (its copies, queued back to back)")
    print(
        f"\nstand-in steps of {args.step_ms} ms, a load before every {args.load_every}th, "
        f"{args.rounds} interleaved rounds of {args.steps} steps"
    )
    print("| | ms per step (median) | ms a load added |")
    print("| --- | ---: | ---: |")
    for name, ms in steps["ms_per_step"].items():
        print(f"| {name} | {ms} | {steps['ms_added_per_load'].get(name, '')} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
