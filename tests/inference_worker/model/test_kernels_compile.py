"""The worker's Triton kernels (RMSNorm, RoPE + KV-cache write, SiLU x up, paged decode and prefill
attention, the skinny decode GEMM and its one-row norm + projection, the row argmax) compile for Hopper (sm_90) without a GPU, for Llama-3.2-1B and
Llama-3-8B shapes, and use no more registers than they have (tests/helpers/triton_compile.py records
the launches of the real wrappers)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from loraserve.inference_worker.model import (
    decode_attention,
    fused_ops,
    launch,
    prefill_attention,
    skinny_gemm,
)
from tests.helpers.triton_compile import compile_launch, record_launches, resources

# (hidden, intermediate, heads, kv heads, head_dim)
SHAPES = {"1b": (2048, 8192, 32, 8, 64), "8b": (4096, 14336, 32, 8, 128)}


def assert_no_spills(launches: list) -> None:
    """Each recorded launch compiles for sm_90 with no stack or local memory (no register spill)."""
    for kernel, args, kwargs in launches:
        use = resources(compile_launch(kernel, args, kwargs).asm["cubin"])
        assert use["STACK"] == 0 and use["LOCAL"] == 0, (kernel.fn.__name__, use)


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_worker_kernels_compile_for_hopper(monkeypatch, shape, pdl) -> None:
    """Also as launched with programmatic dependent launch (model/launch.py), as on a Hopper GPU."""
    hidden, inter, nh, nkv, d = SHAPES[shape]
    monkeypatch.setattr(launch, "pdl_supported", lambda device: pdl)
    t, bf16 = 3, torch.bfloat16
    launches = record_launches(
        monkeypatch, fused_ops, "_rms_norm_kernel", "_rope_cache_kernel", "_silu_mul_kernel"
    )
    record_launches(
        monkeypatch, decode_attention, "_decode_part_kernel", "_decode_reduce_kernel", into=launches
    )
    x = torch.zeros(t, hidden, dtype=bf16)
    fused_ops.rms_norm(x, torch.ones(hidden, dtype=bf16), 1e-5)
    fused_ops.rms_norm(x, torch.ones(hidden, dtype=bf16), 1e-5, residual=x)
    cache = torch.zeros(8, 16, nkv, d, dtype=bf16)  # [blocks, block size, kv heads, head_dim]
    qkv = torch.zeros(t, (nh + 2 * nkv) * d, dtype=bf16)
    fused_ops.rope_and_cache(
        qkv, torch.zeros(t, d, dtype=torch.float32), torch.arange(t), cache, cache.clone(), nh, nkv, d
    )
    fused_ops.silu_mul(torch.zeros(t, 2 * inter, dtype=bf16))
    q, tables, lens = (
        torch.zeros(t, nh, d, dtype=bf16),
        torch.zeros(t, 8, dtype=torch.int32),
        torch.ones(t, dtype=torch.int32),
    )
    decode_attention.paged_decode_attention(q, cache, cache.clone(), tables, lens, d**-0.5)
    # a small batch's split contexts (parts_wanted > 1: the other compiled variant)
    monkeypatch.setattr(decode_attention, "parts_wanted", lambda programs, device: 4)
    decode_attention.paged_decode_attention(q, cache, cache.clone(), tables, lens, d**-0.5)
    assert [kwargs["SPLIT"] for _, _, kwargs in launches[-4:]] == [False, False, True, True]
    assert len(launches) == 8
    assert all(kwargs.get("launch_pdl", False) == pdl for _, _, kwargs in launches)
    assert all(kwargs.get("WAIT_PRIOR", False) == pdl for _, _, kwargs in launches)
    assert_no_spills(launches)


# bf16 and fp16 compile alike; fp32 takes the exact (FMA) products and its own tile sizes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefill_attention_compiles_for_hopper(monkeypatch, shape, dtype) -> None:
    _, _, nh, nkv, d = SHAPES[shape]
    launches = record_launches(monkeypatch, prefill_attention, "_prefill_kernel")
    cache = torch.zeros(8, 16, nkv, d, dtype=dtype)  # [blocks, block size, kv heads, head_dim]
    prefill_attention.paged_prefill_attention(
        torch.zeros(5, nh, d, dtype=dtype),
        cache,
        cache.clone(),
        torch.zeros(2, 8, dtype=torch.int32),
        torch.tensor([3, 20], dtype=torch.int32),
        torch.tensor([0, 3, 5], dtype=torch.int32),
        d**-0.5,
    )
    assert len(launches) == 1
    assert_no_spills(launches)


# (N, K) of the narrow decode projections: q|k|v, o, down
SKINNY_SHAPES = {
    "1b-qkv": (3072, 2048),
    "1b-o": (2048, 2048),
    "1b-down": (2048, 8192),
    "8b-qkv": (6144, 4096),
    "8b-o": (4096, 4096),
    "8b-down": (4096, 14336),
}
H200_SMS = 132


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("shape", list(SKINNY_SHAPES))
def test_skinny_gemm_compiles_for_hopper(monkeypatch, shape, rows, pdl) -> None:
    """The default configuration of each narrow projection (split K or not, dot or not)."""
    n, k = SKINNY_SHAPES[shape]
    monkeypatch.setattr(launch, "pdl_supported", lambda device: pdl)
    launches = record_launches(monkeypatch, skinny_gemm, "_skinny_kernel")
    config = skinny_gemm.default_config(rows, n, k, H200_SMS)
    x, w = torch.zeros(rows, k, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.bfloat16)
    skinny_gemm.skinny_linear(x, w, config=config)
    assert len(launches) == 1
    assert launches[0][2].get("WAIT_PRIOR", False) == pdl
    assert launches[0][2]["SPLIT"] == (config.split_k > 1)
    assert_no_spills(launches)


# (N, K, pair) of the one-row norm + projection kernel (model/skinny_norm.py): q|k|v, gate | up
NORM_SHAPES = {
    "1b-qkv": (3072, 2048, False),
    "1b-gate_up": (16384, 2048, True),
    "8b-qkv": (6144, 4096, False),
    "8b-gate_up": (28672, 4096, True),
}


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("shape", list(NORM_SHAPES))
def test_norm_skinny_compiles_for_hopper(monkeypatch, shape, pdl) -> None:
    """The default configuration, with a residual (and without, the first layer's)."""
    from loraserve.inference_worker.model import skinny_norm

    n, k, pair = NORM_SHAPES[shape]
    monkeypatch.setattr(launch, "pdl_supported", lambda device: pdl)
    launches = record_launches(monkeypatch, skinny_norm, "_norm_skinny_kernel")
    bf16 = torch.bfloat16
    x, nw, w = torch.zeros(1, k, dtype=bf16), torch.ones(k, dtype=bf16), torch.zeros(n, k, dtype=bf16)
    skinny_norm.norm_linear(x, x.clone(), nw, 1e-5, w, pair=pair)
    skinny_norm.norm_linear(x, None, nw, 1e-5, w, pair=pair)
    assert len(launches) == 2
    assert all(kw.get("WAIT_PRIOR", False) == pdl and kw["PAIR"] == pair for _, _, kw in launches)
    assert_no_spills(launches)


@pytest.mark.parametrize("rows", [1, 64])
def test_row_argmax_compiles_for_hopper(monkeypatch, rows) -> None:
    from loraserve.inference_worker.model import row_argmax

    launches = record_launches(monkeypatch, row_argmax, "_row_argmax_kernel")
    row_argmax.row_argmax(torch.zeros(rows, 128256))
    assert len(launches) == 1
    assert_no_spills(launches)


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_norm_qkv_rope_compiles_for_hopper(monkeypatch, shape, pdl) -> None:
    """The one-row norm + q|k|v kernel with its RoPE and cache-write epilogue, with and without a bias."""
    from loraserve.inference_worker.model import skinny_norm, skinny_norm_rope

    hidden, _, nh, nkv, d = SHAPES[shape]
    monkeypatch.setattr(launch, "pdl_supported", lambda device: pdl)
    launches = record_launches(monkeypatch, skinny_norm, "_norm_skinny_kernel")
    bf16 = torch.bfloat16
    x, nw = torch.zeros(1, hidden, dtype=bf16), torch.ones(hidden, dtype=bf16)
    w = torch.zeros((nh + 2 * nkv) * d, hidden, dtype=bf16)
    cache = torch.zeros(8, 16, nkv, d, dtype=bf16)
    cs, slot = torch.zeros(1, d), torch.zeros(1, dtype=torch.int64)
    for bias in (None, torch.zeros(w.shape[0], dtype=bf16)):
        skinny_norm_rope.norm_qkv_rope(
            x, x.clone(), nw, 1e-5, w, bias, cs, slot, cache, cache.clone(), nh, nkv, d
        )
    assert len(launches) == 2 and all(kw["ROPE"] for _, _, kw in launches)
    assert_no_spills(launches)
