"""Kernel test cases shared by the reference (CPU), interpreter (CPU) and GPU tests.

Each case draws fresh random inputs (never zeros), poisons every output element that must be
written, runs shrink, expand and add_lora through the public ops, and returns a list of failures
against the float64 formula; rows of slot -1 must come back bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.kernels import (
    LaunchOptions,
    LoRABatch,
    add_lora,
    add_lora_begin,
    add_lora_finish,
    add_lora_silu_mul,
    lora_expand,
    lora_shrink,
)
from tests.helpers.lora_formula import lora_delta64, shrink64

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class Case:
    name: str
    num_tokens: int
    in_features: int
    widths: tuple[int, ...]  # output width of each slice
    max_rank: int
    ranks: tuple[int, ...]  # rank of each slot (0 = slot unused)
    slots: str  # "random", "one", "distinct", "base", "sorted", "mixed-base"
    max_tokens: int = 0  # batch capacity (default: num_tokens)
    seed: int = 0


CASES: tuple[Case, ...] = (
    Case("random-slots-with-base-rows", 37, 40, (24,), 8, (8, 3, 5, 8), "random"),
    Case("all-rows-one-adapter", 33, 48, (40,), 16, (16, 16, 16), "one"),
    Case("every-row-distinct-adapter", 9, 32, (33,), 9, tuple(range(1, 10)), "distinct"),
    Case("all-rows-base-model", 12, 32, (16,), 8, (8, 8), "base"),
    Case("mixed-ranks-unsorted", 40, 36, (20, 12), 16, (16, 2, 9, 0, 13), "random"),
    Case("rank-one", 20, 17, (19,), 1, (1, 1, 1), "random"),
    Case("odd-dims", 23, 51, (37,), 7, (7, 5, 3), "random"),
    Case("qkv-unequal-slices", 30, 64, (48, 16, 16), 16, (16, 4, 11), "random"),
    Case("rank-past-one-tile", 21, 24, (18, 10), 40, (40, 33, 17), "random"),
    Case("rank-over-128", 11, 24, (20,), 136, (136, 70, 129), "random"),
    Case("rank-over-128-split-k", 5, 700, (20,), 136, (136, 130), "one"),
    Case("split-k-one-adapter", 5, 700, (24, 8), 8, (8, 6), "one"),
    Case("wide-output-chunks", 7, 16, (600, 300), 8, (8, 5, 2), "random"),
    Case("zero-rows", 0, 32, (16, 8), 8, (8, 8), "random", max_tokens=8),
    Case("prefill-long-segments", 560, 40, (24, 8), 16, (16, 5, 12), "mixed-base"),
    Case("prefill-wide-rank", 530, 20, (16, 8, 8), 100, (100, 7, 64), "mixed-base"),
    # gate | up pairs (two equal slices): add_lora_silu_mul runs on these too
    Case("gate-up-pairs", 29, 40, (24, 24), 16, (16, 3, 0, 9), "random"),
    Case("gate-up-split-k", 5, 700, (40, 40), 8, (8, 6), "one"),
    Case("gate-up-rank-over-128", 6, 24, (20, 20), 136, (136, 70), "random"),
    Case("gate-up-prefill", 530, 24, (16, 16), 16, (16, 5, 12), "mixed-base"),
    Case("gate-up-base-only", 9, 16, (12, 12), 8, (8,), "base"),
)


def make_slots(case: Case, gen: torch.Generator) -> list[int]:
    num_loras, t = len(case.ranks), case.num_tokens
    if case.slots == "one":
        return [1] * t
    if case.slots == "distinct":
        return [int(i) for i in torch.randperm(num_loras, generator=gen)[:t]]
    if case.slots == "base":
        return [-1] * t
    if case.slots == "mixed-base":
        # long runs of a few slots, interleaved with base rows, in no sorted order
        runs = [2, -1, 0, 2, -1, 1]
        return [runs[(i * len(runs)) // max(t, 1)] if i % 7 else -1 for i in range(t)]
    return [int(s) for s in torch.randint(-1, num_loras, (t,), generator=gen)]


def _garbage_past_rank(tensor: torch.Tensor, ranks: tuple[int, ...], rank_dim: int) -> None:
    """Fill entries past each slot's rank with NaN: reading them into a sum fails the comparison
    (even multiplied by a zero, where a finite value would vanish)."""
    for slot, r in enumerate(ranks):
        view = tensor[slot].narrow(rank_dim - 1, r, tensor.shape[rank_dim] - r)
        view.fill_(float("nan"))


PATHS = ("shrink", "expand", "add_lora", "begin_finish", "silu_mul")  # silu_mul: gate | up pairs only


def run_case(
    case: Case,
    dtype: torch.dtype,
    device: str,
    backend: str | None,
    paths: tuple[str, ...] = PATHS,
    options: LaunchOptions | None = None,
) -> list[str]:
    """Failures of the ops named in `paths`."""
    gen = torch.Generator().manual_seed(case.seed + 1000 * len(case.name))
    num_tokens, din, num_slices = case.num_tokens, case.in_features, len(case.widths)
    num_loras, max_rank = len(case.ranks), case.max_rank
    offsets = [0]
    for w in case.widths:
        offsets.append(offsets[-1] + w)
    out_features = offsets[-1]
    slots = make_slots(case, gen)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    x = rand(num_tokens, din)
    lora_a = rand(num_loras, num_slices, max_rank, din, scale=din**-0.5)
    lora_b = rand(num_loras, out_features, max_rank, scale=max(1, max_rank) ** -0.5)
    y0 = rand(num_tokens, out_features)
    _garbage_past_rank(lora_a, case.ranks, 2)
    _garbage_past_rank(lora_b, case.ranks, 2)
    ranks = torch.tensor(case.ranks, dtype=torch.int32)
    ref_delta = lora_delta64(x, lora_a, lora_b, list(case.ranks), slots, offsets)
    ref_s = shrink64(x, lora_a, list(case.ranks), slots)

    x, lora_a, lora_b, ranks = (t.to(device) for t in (x, lora_a, lora_b, ranks))
    batch = LoRABatch.allocate(
        max(case.max_tokens, num_tokens), num_loras, device, max_slices=num_slices, max_rank=max_rank
    )
    batch.prepare(torch.tensor(slots, dtype=torch.int32, device=device))
    failures: list[str] = []
    tol = TOLERANCE[dtype]
    lora_rows = [t for t, s in enumerate(slots) if s >= 0 and case.ranks[s] > 0]
    base_rows = [t for t in range(num_tokens) if t not in set(lora_rows)]

    written = torch.zeros((num_slices, num_tokens, max_rank), dtype=torch.bool)
    for t in lora_rows:
        written[:, t, : case.ranks[slots[t]]] = True
    if "shrink" in paths:
        failures += _check_shrink(x, lora_a, ranks, batch, backend, written, ref_s, tol)

    if "expand" in paths:  # from the exact s (poisoned where unread) into y.
        s_in = torch.where(written, ref_s, float("nan")).float().to(device)
        y = y0.clone().to(device)
        lora_expand(s_in, lora_b, ranks, batch, offsets, y, backend=backend)
        failures += _check_y("expand", y.cpu(), y0, ref_delta, lora_rows, base_rows, tol)

    if "add_lora" in paths:
        y = y0.clone().to(device)
        add_lora(y, x, lora_a, lora_b, ranks, batch, offsets, backend=backend, options=options)
        failures += _check_y("add_lora", y.cpu(), y0, ref_delta, lora_rows, base_rows, tol)

    if "begin_finish" in paths:  # add_lora in two calls (the shrink beside y's producer)
        y = y0.clone().to(device)
        begun = add_lora_begin(x, lora_a, ranks, batch, backend=backend, options=options)
        add_lora_finish(begun, y, lora_b, ranks, batch, offsets, options=options)
        failures += _check_y("add_lora_begin/finish", y.cpu(), y0, ref_delta, lora_rows, base_rows, tol)

    if "silu_mul" in paths and num_slices == 2 and case.widths[0] == case.widths[1]:
        failures += _check_silu_mul(case, y0, ref_delta, x, lora_a, lora_b, ranks, batch, backend, options)
    return failures


def silu_mul64(z: torch.Tensor, inter: int) -> torch.Tensor:
    gate, up = z[:, :inter], z[:, inter:]
    return gate * torch.sigmoid(gate) * up


def _check_silu_mul(
    case: Case,
    y0: torch.Tensor,
    ref_delta: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    batch: LoRABatch,
    backend: str | None,
    options: LaunchOptions | None,
) -> list[str]:
    """Every output element poisoned first; y must come back untouched; the result within the
    dtype's tolerance of the float64 formula on y + delta, and (where y's own rounding decides) of
    the same formula on y + delta rounded to y's dtype."""
    inter = case.widths[0]
    dtype = y0.dtype
    y = y0.clone().to(x.device)
    out = torch.full((case.num_tokens, inter), float("nan"), dtype=dtype, device=x.device)
    add_lora_silu_mul(y, x, lora_a, lora_b, ranks, batch, out, backend=backend, options=options)
    failures = []
    if not torch.equal(y.cpu(), y0):
        failures.append("silu_mul: y was modified")
    got = out.cpu().double()
    if torch.isnan(got).any():
        failures.append("silu_mul: output left unwritten (NaN)")
        return failures
    want = silu_mul64(y0.double() + ref_delta, inter)
    want_rounded = silu_mul64((y0.double() + ref_delta).to(dtype).double(), inter)
    tol = TOLERANCE[dtype]
    err = min(_rel(got, want), _rel(got, want_rounded)) if case.num_tokens else 0.0
    if not err <= 2 * tol:
        failures.append(f"silu_mul: relative error {err:.2e}")
    return failures


def _check_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    ranks: torch.Tensor,
    batch: LoRABatch,
    backend: str | None,
    written: torch.Tensor,
    ref_s: torch.Tensor,
    tol: float,
) -> list[str]:
    """Every meaningful element of s poisoned first: it must be written and match."""
    failures = []
    s = torch.full(written.shape, float("nan"), dtype=torch.float32, device=x.device)
    lora_shrink(x, lora_a, ranks, batch, s, backend=backend)
    s_cpu = s.cpu().double()
    if torch.isnan(s_cpu[written]).any():
        failures.append("shrink left elements unwritten")
    if not torch.isnan(s_cpu[~written]).all():
        failures.append("shrink wrote past a rank or into a base row")
    if written.any():
        err = _rel(s_cpu[written], ref_s[written])
        if not err <= tol:
            failures.append(f"shrink relative error {err:.2e}")
    return failures


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def _check_y(
    op: str,
    y: torch.Tensor,
    y0: torch.Tensor,
    delta: torch.Tensor,
    lora_rows: list[int],
    base_rows: list[int],
    tol: float,
) -> list[str]:
    failures = []
    if torch.isnan(y).any():
        failures.append(f"{op}: NaN in output")
    if base_rows and not torch.equal(y[base_rows], y0[base_rows]):
        failures.append(f"{op}: base-model rows were modified")
    if lora_rows:
        got = y[lora_rows].double() - y0[lora_rows].double()
        want = delta[lora_rows]
        # The output rounding of y itself bounds how well the delta can be recovered.
        ulp = (
            y0[lora_rows].double().abs().max().item()
            * {torch.float32: 1.2e-7, torch.float16: 1e-3, torch.bfloat16: 8e-3}[y.dtype]
        )
        err = _rel(got, want)
        abs_err = float((got - want).abs().max())
        if not (err <= tol or abs_err <= 2 * ulp):
            failures.append(f"{op}: relative error {err:.2e} (max abs {abs_err:.2e})")
    return failures
