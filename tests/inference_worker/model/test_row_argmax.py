"""The decode graphs' greedy choice (model/row_argmax.py) equals torch.argmax exactly: ties to the
lowest column within a chunk and across chunks, -inf rows, NaN, rows that end inside a chunk; the
arrival counters are zero after every launch. Through Triton's interpreter on CPU (a subprocess of
its own), and on CUDA also at a 128K vocabulary with bf16-rounded logits and in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from loraserve.inference_worker.model.row_argmax import row_argmax
from tests.helpers.interpreter import interpreted_value

CASE = r"""
import torch
from loraserve.inference_worker.model import arrival_counters
from loraserve.inference_worker.model.row_argmax import BLOCK, row_argmax

def rows(device, n, v, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g)
    x[0] = x[0].to(torch.bfloat16).float()  # rounded: many equal values
    if n > 1 and v > 8:  # one maximum in an early and a late chunk (and inside the first chunk twice)
        x[1, :] = 0.0
        x[1, [5, 7, v - 1]] = 3.0
    if n > 2:
        x[2] = float("-inf")
    if n > 3 and v > 2:
        x[3, v // 2] = float("nan")
        x[3, v - 2] = float("nan")
    if n > 4 and v > 2:
        x[4, v - 1] = float("inf")
        x[4, 1] = float("inf")
    return x.to(device)

def check(device, n, v, seed, failures):
    x = rows(device, n, v, seed)
    out = torch.full((n,), -7, dtype=torch.int64, device=device)
    got = row_argmax(x, out=out)
    want = torch.argmax(x.cpu(), dim=-1).to(device)
    if got is not out or not torch.equal(got, want):
        failures.append(f"n={n} v={v}: {got.tolist()} != {want.tolist()}")
    counters = arrival_counters._counters.get(x.device)
    if counters is not None and counters.any():
        failures.append(f"n={n} v={v}: arrival counters not zero")

def cases(device, sizes):
    failures = []
    for i, (n, v) in enumerate(sizes):
        check(device, n, v, i, failures)
    return failures
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test covers the kernel")
def test_kernel_in_triton_interpreter() -> None:
    pytest.importorskip("triton")
    sizes = [(5, 9000), (5, 4096), (2, 1), (1, 4097), (3, 100)]
    assert interpreted_value(CASE, f"cases('cpu', {sizes!r})") == []


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="float32"):
        row_argmax(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="unit column stride"):
        row_argmax(torch.zeros(8, 2).T)
    with pytest.raises(ValueError, match="out must be"):
        row_argmax(torch.zeros(2, 8), out=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="empty row"):
        row_argmax(torch.zeros(2, 0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_cuda() -> None:
    ns: dict = {}
    exec(CASE, ns)
    sizes = [(5, 9000), (5, 4096), (2, 1), (1, 4097), (5, 128256), (64, 128256), (256, 32000)]
    assert ns["cases"]("cuda", sizes) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_in_cuda_graph() -> None:
    """Captured once, replayed on new logits (bf16-rounded, so with ties)."""
    x = torch.zeros(16, 128256, device="cuda")
    out = torch.zeros(16, dtype=torch.int64, device="cuda")
    row_argmax(x, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        row_argmax(x, out=out)
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, device="cuda", generator=g).to(torch.bfloat16).float())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.argmax(x, dim=-1))
