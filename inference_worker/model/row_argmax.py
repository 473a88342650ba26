"""The greedy choice of each row of a decode step's logits in one Triton launch spread over the GPU:

    row_argmax(x [N, V] float32, out [N] int64) -> out: out[n] = torch.argmax(x[n])

torch.argmax reduces a row in one block of threads: a 128K vocabulary took ~27 µs a step on an
H200 at one row (~3 % of a Llama-3.2-1B step). Here each program takes one chunk of BLOCK columns of
one row and stores its maximum and the first column holding it; the program that arrives last at
its row (an int32 arrival counter per row, acq_rel atomic add, as model/skinny_gemm.py) picks the
first chunk holding the row's maximum, stores its column and sets the counter back to 0 (CUDA-graph
replays find it zero). So ties go to the lowest column, as torch.argmax's. A NaN counts as greater
than every number, as in torch.argmax; in a row with NaN and +inf the first of either wins.

The counters are model/arrival_counters.py's (one zeroed buffer per device, shared with the skinny
GEMM's split-K launches): the launches sharing them run on one stream, one after another.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraserve.inference_worker.model.arrival_counters import arrival_counters

BLOCK = 4096  # columns a program
MAX_CHUNKS = 1024  # chunks a row (vocabularies up to 4M columns)


@triton.jit
def _row_argmax_kernel(X, VALS, IDX, OUT, CNT, V, s_x, CHUNKS, BLOCK: tl.constexpr, CHUNKS_POW: tl.constexpr):  # type: ignore[no-untyped-def]
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row.to(tl.int64) * s_x + cols, mask=cols < V, other=float("-inf"))
    x = tl.where(x != x, float("inf"), x)  # NaN: above every number
    best, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    slot = row * CHUNKS + chunk
    tl.store(VALS + slot, best)
    tl.store(IDX + slot, chunk * BLOCK + at)
    tl.debug_barrier()  # the chunk's result stored before its arrival is published
    arrived = tl.atomic_add(CNT + row, 1, sem="acq_rel")
    if arrived == CHUNKS - 1:  # the row's last chunk: the first chunk holding the row's maximum
        cs = tl.arange(0, CHUNKS_POW)
        ok = cs < CHUNKS
        vals = tl.load(VALS + row * CHUNKS + cs, mask=ok, other=float("-inf"), cache_modifier=".cg")
        idx = tl.load(IDX + row * CHUNKS + cs, mask=ok, other=0, cache_modifier=".cg")
        j = tl.argmax(vals, 0, tie_break_left=True)
        tl.store(OUT + row, tl.sum(tl.where(cs == j, idx, 0), 0).to(tl.int64))
        tl.store(CNT + row, 0)  # zero again for the next launch


def row_argmax(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, V] float32 (unit column stride) -> out [N] int64, the first column of each row's
    maximum. `out`: where to write (a new tensor if None)."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(f"x must be [N, V] float32 with unit column stride, got {tuple(x.shape)} {x.dtype}")
    n, v = x.shape
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=x.device)
    if out.shape != (n,) or out.dtype != torch.int64 or out.device != x.device:
        raise ValueError(f"out must be [{n}] int64 on x's device, got {tuple(out.shape)} {out.dtype}")
    if v == 0:
        raise ValueError("argmax of an empty row")
    chunks = triton.cdiv(v, BLOCK)
    if chunks > MAX_CHUNKS:
        raise ValueError(f"rows of at most {MAX_CHUNKS * BLOCK} columns, got {v}")
    if n == 0:
        return out
    vals = torch.empty((n, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((n, chunks), dtype=torch.int32, device=x.device)
    _row_argmax_kernel[(n, chunks)](
        x,
        vals,
        idx,
        out,
        arrival_counters(x.device, n),
        v,
        x.stride(0),
        chunks,
        BLOCK=BLOCK,
        CHUNKS_POW=triton.next_power_of_2(chunks),
        num_warps=4,
    )
    return out
