"""Runs every kernel case through the Triton interpreter and prints {case: failures} as JSON.

Executed in a child process by test_sgmv_interpreter.py, so TRITON_INTERPRET=1 is set before the
kernels are defined (kernels.ops imports them lazily) and never leaks into the parent test process.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from tests.helpers.lora_cases import CASES, run_case

DTYPES = {"float32": torch.float32, "float16": torch.float16}


def main(names: list[str]) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    results: dict[str, list[str]] = {}
    for case in CASES:
        for dtype_name, dtype in DTYPES.items():
            key = f"{case.name}-{dtype_name}"
            if names and key not in names:
                continue
            try:
                results[key] = run_case(case, dtype, "cpu", "triton")
            except Exception as exc:
                results[key] = [f"{type(exc).__name__}: {exc}"]
    # add_lora again with the expand's preloading loop (the structure it has when launched with
    # PDL on a GPU; the interpreter has no grid dependency control, so only the loop is checked).
    from loraserve.kernels import LaunchOptions

    preload = LaunchOptions(expand_preload=True)
    for case in CASES:
        key = f"{case.name}-float16-preload"
        if names and key not in names:
            continue
        try:
            results[key] = run_case(
                case, torch.float16, "cpu", "triton", paths=("add_lora",), options=preload
            )
        except Exception as exc:
            results[key] = [f"{type(exc).__name__}: {exc}"]
    if not names or "prepare" in names:
        results["prepare"] = compare_prepare()
    if not names or "slice-limit" in names:
        results["slice-limit"] = slice_limit_before_launch()
    print(json.dumps(results))


def compare_prepare() -> list[str]:
    """The one-launch Triton prepare against the torch-op version, on random slot vectors."""
    from loraserve.kernels import LoRABatch
    from loraserve.kernels.batch import max_work_items

    failures = []
    gen = torch.Generator().manual_seed(5)
    # more slots than one block of bins (1,100: two), rows over several blocks, one slot, no slot
    trials = [(1, 5), (3, 70), (20, 33), (40, 150), (7, 0), (5, 130), (300, 200), (1100, 150), (1024, 70)]
    trials += [(1100, 140), (64, 64)]
    for trial, (num_loras, num_tokens) in enumerate(trials):
        slots = torch.randint(-1, num_loras, (num_tokens,), generator=gen, dtype=torch.int32)
        if trial == 5:
            slots[:] = 2
        if trial == 9:  # the last slots, past the first block of bins
            slots = torch.randint(1020, num_loras, (num_tokens,), generator=gen, dtype=torch.int32)
        if trial == 10:
            slots[:] = -1
        want, got = (LoRABatch.allocate(200, num_loras, "cpu") for _ in range(2))
        want.prepare(slots, use_triton=False)
        got.prepare(torch.zeros(9, dtype=torch.int32), use_triton=True)  # stale state to overwrite
        got.prepare(slots, use_triton=True)
        pairs = [
            ("sorted_rows", want.sorted_rows[:num_tokens], got.sorted_rows[:num_tokens]),
            ("slot_starts", want.slot_starts, got.slot_starts),
            ("slot_counts", want.slot_counts, got.slot_counts),
        ]
        for m in want.work:
            n = int(want.work[m].count)
            pairs += [(f"work{m}.count", want.work[m].count, got.work[m].count)]
            pairs += [
                (f"work{m}.{f}", getattr(want.work[m], f)[:n], getattr(got.work[m], f)[:n])
                for f in ("slot", "start", "end")
            ]
            bound = max_work_items(num_tokens, num_loras, m)
            pairs += [
                (
                    f"work{m}.{f} past count",
                    getattr(want.work[m], f)[n:bound],
                    getattr(got.work[m], f)[n:bound],
                )
                for f in ("slot", "start", "end")
            ]
        failures += [
            f"L={num_loras} T={num_tokens}: {name} differs" for name, a, b in pairs if not torch.equal(a, b)
        ]
    return failures


def slice_limit_before_launch() -> list[str]:
    """add_lora with more slices than the Triton expand handles raises before the shrink runs."""
    from loraserve.kernels import LoRABatch, add_lora
    from loraserve.kernels.launch_plan import MAX_SLICES

    num_slices = MAX_SLICES + 1
    gen = torch.Generator().manual_seed(9)
    batch = LoRABatch.allocate(4, 2, "cpu", max_slices=num_slices, max_rank=4)
    batch.prepare(torch.tensor([0, 1, -1, 0], dtype=torch.int32))
    batch.workspace.fill_(float("nan"))
    x = torch.randn(4, 8, generator=gen)
    lora_a = torch.randn(2, num_slices, 4, 8, generator=gen)
    lora_b = torch.randn(2, 2 * num_slices, 4, generator=gen)
    ranks = torch.full((2,), 4, dtype=torch.int32)
    y0 = torch.randn(4, 2 * num_slices, generator=gen)
    y = y0.clone()
    failures = []
    try:
        add_lora(y, x, lora_a, lora_b, ranks, batch, list(range(0, 2 * num_slices + 1, 2)), backend="triton")
        failures.append(f"{num_slices} slices were accepted")
    except ValueError as exc:
        if f"up to {MAX_SLICES} slices" not in str(exc):
            failures.append(f"unexpected error: {exc}")
    if not torch.isnan(batch.workspace).all():
        failures.append("the shrink ran before the slice limit was checked")
    if not torch.equal(y, y0):
        failures.append("y was modified")
    return failures


if __name__ == "__main__":
    main(sys.argv[1:])
