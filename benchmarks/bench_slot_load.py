"""What one adapter's copy into a GPU slot costs the engine's step thread: `LoRASlots.load` of a
pinned payload (the serving benchmark's 1B shape, rank 16, all modules), host wall time per call,
alone and beside threads that keep the interpreter lock busy as a serving worker's do
(bench_fetch_contention.Busy), and the device time of the copies it queues (queued back to back
behind a held stream, so the host's pace does not enter it). Also the event loop's share: `LoRASlots.check` (the copy plan, built once per fetched payload).

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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--loads", type=int, default=200)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=64)
    p.add_argument("--switch-interval-ms", type=float, default=0.5, help="as the worker sets it")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    shape = SHAPES["1b"]
    config = llama_config(shape, shape.vocab_size, bos_id=1, eos_id=2)
    slots = LoRASlots(config, args.max_loras, args.rank, torch.bfloat16, "cuda")
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
        slots.load(0, pl)  # plans, views and the staging buffer made once
    torch.cuda.synchronize()
    for load_name, busy in (("load, alone", False), ("load, busy interpreter", True)):
        host_ms = []
        with Busy() if busy else contextlib.nullcontext():
            for i in range(args.loads):
                t0 = time.perf_counter()
                slots.load(i % args.max_loras, payloads[i % len(payloads)])
                host_ms.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        rows[load_name] = percentiles(host_ms)
    # The device's part: loads queued back to back, the stream held until all are queued, so the
    # span between the events is the copies alone, not the host's pace.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2e9))  # ~1 s of spinning while the loads queue behind it
    start.record()
    for i in range(args.loads):
        slots.load(i % args.max_loras, payloads[i % len(payloads)])
    end.record()
    end.synchronize()
    device_ms = round(start.elapsed_time(end) / args.loads, 4)
    nbytes = payloads[0].nbytes
    out = {
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "payload_bytes": nbytes,
        "rank": args.rank,
        "rows": rows,
        "device_ms_per_load": device_ms,
    }
    print(f"\none {nbytes / 1e6:.1f} MB payload (1b shape, rank {args.rank}), {out['device']}")
    print("| host ms per call | median | p90 | mean |")
    print("| --- | ---: | ---: | ---: |")
    for name, r in rows.items():
        print(f"| {name} | {r['median']} | {r['p90']} | {r['mean']} |")
    print(f"device: {device_ms} ms per load (its copies, queued back to back)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
