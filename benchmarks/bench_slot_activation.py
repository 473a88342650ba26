"""Slot activation on the step thread: copy launches and host time per activation of a CPU-tier
payload into a GPU slot (CPU too), for a Llama-3.2-1B-shaped adapter on all seven modules, with
one rank everywhere and with ranks that differ across layers (PEFT rank_pattern).

    python benchmarks/bench_slot_activation.py [--shape 1b] [--reps 50]

Copies are the aten copy_ calls `LoRASlots.load` issues (each one launch on CUDA; a copy into a
non-contiguous destination from the host is two); the time is the host's, launches only
(the copies themselves run asynchronously on CUDA), then the device time with a sync."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_lora_worker import ALPHA, RANK, hf_config
from loraserve.adapter_store.optimize import optimize
from loraserve.adapter_store.validate import LoraAdapter, LoraModule, scale_of
from loraserve.contract.adapter_layout import MODULES, module_shapes
from loraserve.contract.payload import PayloadTensor
from loraserve.inference_worker.lora.payload import AdapterPayload
from loraserve.inference_worker.lora.slots import LoRASlots


class CopyCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.copies += func is torch.ops.aten.copy_.default
        return func(*args, **(kwargs or {}))


def payload(cfg: dict, rank_of_layer) -> AdapterPayload:
    g = torch.Generator().manual_seed(0)
    shapes, modules = module_shapes(cfg), {}
    for layer in range(cfg["num_hidden_layers"]):
        r = rank_of_layer(layer)
        for m in MODULES:
            n_in, n_out = shapes[m]
            a, b = torch.randn(r, n_in, generator=g) * 0.02, torch.randn(n_out, r, generator=g) * 0.02
            modules[(layer, m)] = LoraModule(layer, m, r, ALPHA, scale_of(ALPHA, r, False), a, b)
    opt = optimize(LoraAdapter(modules, RANK, ALPHA, False), cfg, "bfloat16")
    tensors = [PayloadTensor(t.name, t.shape, t.dtype, t.offset, t.nbytes) for t in opt.tensors]
    return AdapterPayload("bench", opt.digest, opt.rank, opt.payload, tensors)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(slots: LoRASlots, p: AdapterPayload, reps: int) -> dict:
    if hasattr(slots, "pack"):  # the worker packs a payload once, when it is fetched
        p = slots.pack(p)
    slots.load(0, p)
    with CopyCount() as count:
        slots.load(1, p)
    host, total = [], []
    for i in range(reps):
        sync()
        t0 = time.perf_counter()
        slots.load(i % slots.max_loras, p)
        t1 = time.perf_counter()
        sync()
        host.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    return {
        "copies": count.copies,
        "host_ms": statistics.median(host) * 1e3,
        "with_sync_ms": statistics.median(total) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = hf_config(args.shape)
    slots = LoRASlots(cfg, 4, 64, torch.bfloat16, device)
    cases = {
        f"rank {RANK} everywhere": lambda layer: RANK,
        "ranks 8/16 alternating by layer": lambda layer: 8 if layer % 2 else 16,
    }
    print(f"device {device}, shape {args.shape}, {cfg['num_hidden_layers']} layers x 7 modules")
    for name, rank_of in cases.items():
        r = measure(slots, payload(cfg, rank_of), args.reps)
        print(
            f"{name:34s} copies/activation {r['copies']:4d}  host {r['host_ms']:.3f} ms  "
            f"with sync {r['with_sync_ms']:.3f} ms"
        )


if __name__ == "__main__":
    main()
