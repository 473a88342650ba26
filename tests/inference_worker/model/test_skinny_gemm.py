"""The skinny GEMM (model/skinny_gemm.py) against a float64 oracle: the Triton kernel through the
interpreter on CPU (float32 and float16; the interpreter's bf16 dot is wrong), in a subprocess so the
interpreter setting does not leak into other tests; the plain-torch twin on CPU; argument checks; the
default configuration; and on CUDA, bf16 on Llama-3.2-1B / Llama-3-8B shapes, also in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from loraserve.inference_worker.model.skinny_gemm import (
    SkinnyConfig,
    default_config,
    skinny_linear,
    skinny_linear_reference,
)
from tests.helpers.interpreter import interpreted_value

CASE = r"""
import torch
from loraserve.inference_worker.model import arrival_counters
from loraserve.inference_worker.model.skinny_gemm import SkinnyConfig, skinny_linear

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}

def oracle(x, w, b):
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y

def check(device, dtype, m, n, k, bias, config, name, failures, stride=None):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    scale = k ** -0.5 if k > 1000 else 1.0
    x = (torch.randn(m, stride or k, generator=g) * scale).to(device, dtype)[:, :k]
    w = torch.randn(n, k, generator=g).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    y = skinny_linear(x, w, b, config=config)
    again = skinny_linear(x, w, b, config=config)  # counters zero again, same bits
    try:
        assert y.dtype == dtype and y.shape == (m, n), (y.dtype, y.shape)
        tol = TOL[dtype]
        torch.testing.assert_close(y.double(), oracle(x, w, b), rtol=tol, atol=tol)
        assert torch.equal(y, again), "two launches differ"
        counters = arrival_counters._counters.get(x.device)
        assert counters is None or not counters.any(), "arrival counters not zero"
    except AssertionError as e:
        failures.append(f"{name}: {e}")

def interpreter_cases():
    failures = []
    for dtype in (torch.float32, torch.float16):
        for m in (1, 3, 16):
            for bias in (False, True):
                for split in (1, 3):
                    for dot in (True, False):
                        # 48 x 80: neither a multiple of the 32 x 32 tiles
                        config = SkinnyConfig(block_n=32, block_k=32, split_k=split, use_dot=dot)
                        name = f"{dtype} m={m} bias={bias} split={split} dot={dot}"
                        check("cpu", dtype, m, 48, 80, bias, config, name, failures)
        # K a multiple of the tiles (no K masks), a row stride > K, the default config
        check("cpu", dtype, 2, 40, 64, True, SkinnyConfig(16, 16, 2, use_dot=False), f"{dtype} even", failures)
        check("cpu", dtype, 5, 24, 40, False, SkinnyConfig(8, 16, 2, use_dot=False), f"{dtype} stride", failures, stride=56)
        check("cpu", dtype, 4, 48, 80, False, None, f"{dtype} default", failures)
    return failures
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test covers the kernel")
def test_kernel_in_triton_interpreter() -> None:
    pytest.importorskip("triton")
    assert interpreted_value(CASE, "interpreter_cases()") == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_reference_twin_matches_float64(dtype, bias) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 96, generator=g).to(dtype)
    w = torch.randn(40, 96, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype) if bias else None
    y = skinny_linear_reference(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    tol = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}[dtype]
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("fn", [skinny_linear, skinny_linear_reference])
def test_bad_arguments_raise_before_launch(fn) -> None:
    x, w = torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(8, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most 16 rows"):
        fn(torch.zeros(17, 32, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="K=31"):
        fn(x[:, :31], w)
    with pytest.raises(ValueError, match="share one of"):
        fn(x.half(), w)
    with pytest.raises(ValueError, match="share one of"):
        fn(x.int(), w.int())
    with pytest.raises(ValueError, match="bias"):
        fn(x, w, torch.zeros(9, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        fn(x, torch.zeros(32, 8, dtype=torch.bfloat16).T)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        fn(x[0], w)


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="power of two"):
        SkinnyConfig(block_n=24)
    with pytest.raises(ValueError, match="use_dot"):
        SkinnyConfig(block_n=8, use_dot=True)
    with pytest.raises(ValueError, match="split_k"):
        SkinnyConfig(split_k=0)
    assert SkinnyConfig(block_n=8, use_dot=False).block_n == 8


# (N, K) of the decode projections: q|k|v, o, gate|up, down, lm_head
SHAPES = {
    "1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)],
    "8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)],
}


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("model", list(SHAPES))
def test_default_config_spreads_the_weights(model, m) -> None:
    """On an H200 (132 SMs): at least one program per SM, each reading >= 32 KB of 16-bit w."""
    for n, k in SHAPES[model]:
        c = default_config(m, n, k, 132)
        programs = -(-n // c.block_n) * c.split_k
        assert programs >= 132, (n, k, c)
        assert c.block_n * (k // c.split_k) * 2 >= 32 * 1024, (n, k, c)
        assert c.use_dot == (m > 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", list(SHAPES))
def test_kernel_on_cuda(model) -> None:
    ns: dict = {}
    exec(CASE, ns)
    failures: list[str] = []
    for n, k in SHAPES[model]:
        for m in (1, 5, 16):
            for config in (
                None,
                SkinnyConfig(16, 256, 4, use_dot=m > 1),
                SkinnyConfig(32, 128, 1, use_dot=False),
            ):
                name = f"{n}x{k} m={m} {config}"
                ns["check"]("cuda", torch.bfloat16, m, n, k, m == 5, config, name, failures)
    for dtype in (torch.float16, torch.float32):
        ns["check"]("cuda", dtype, 3, 2048, 2048, True, None, f"{dtype}", failures)
    assert failures == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split", [1, 4])
def test_kernel_in_cuda_graph(split) -> None:
    """Captured once (split K: workspace and counters), replayed twice on new inputs."""
    dev, dtype, (n, k) = torch.device("cuda"), torch.bfloat16, SHAPES["8b"][3]
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(dtype)
    x = torch.randn(8, k, device=dev, generator=g).to(dtype)
    config = SkinnyConfig(16, 256, split, use_dot=True)
    skinny_linear(x, w, config=config)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_linear(x, w, config=config)
    for _ in range(2):
        x.copy_(torch.randn(8, k, device=dev, generator=g).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        ref = x.double() @ w.double().T
        torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2)
        assert torch.equal(y, skinny_linear(x, w, config=config))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_linear_runs_one_row_steps_through_the_skinny_gemm(monkeypatch) -> None:
    """A one-row step of a narrow bf16 projection on CUDA takes the skinny GEMM, more rows and wide
    projections cuBLAS; both give the projection."""
    from loraserve.inference_worker.model import linear, skinny_gemm

    calls: list[int] = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    narrow = linear.GroupedLinear(0, "qkv", 2048, [2048, 512, 512], False, torch.bfloat16, "cuda")
    wide = linear.GroupedLinear(0, "gate_up", 4096, [14336, 14336], False, torch.bfloat16, "cuda")
    assert narrow.skinny and not wide.skinny
    for layer in (narrow, wide):
        torch.nn.init.normal_(layer.weight, std=0.02)
        for rows in (1, 4):
            x = torch.randn(rows, layer.in_features, device="cuda", dtype=torch.bfloat16)
            want = x.double() @ layer.weight.double().T
            torch.testing.assert_close(layer.project(x).double(), want, atol=2e-2, rtol=2e-2)
    assert len(calls) == 1
