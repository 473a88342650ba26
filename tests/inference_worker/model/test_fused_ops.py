"""The fused Triton kernels of the CUDA path against their plain-torch twins in the model code."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.interpreter import interpreted

CASE = r"""
import torch
from torch.nn import functional as F
from loraserve.inference_worker.model.attention import write_kv
from loraserve.inference_worker.model.fused_ops import rms_norm, rope_and_cache, silu_mul
from loraserve.inference_worker.model.rope import apply_rope, rope_cache

def check(device, dtype, t, h, nh, nkv, d, inter, atol):
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(device, dtype)
    x, r, w = rnd(t, h), rnd(t, h), rnd(h)
    # rms norm with and without the residual add
    for res in (None, r):
        y, ro = rms_norm(x, w, 1e-5, res)
        xr = x + res if res is not None else x
        xf = xr.float()
        ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        torch.testing.assert_close(y.float(), ref.float(), atol=atol, rtol=atol)
        if res is not None:
            torch.testing.assert_close(ro, xr)
    # rope + cache write
    qkv = rnd(t, (nh + 2 * nkv) * d)
    cs = rope_cache([1.0 / 10000 ** (i / d) for i in range(0, d, 2)], 4096, device)[torch.randint(0, 4096, (t,), generator=g).to(device)]
    nb, bs = 8, 16
    slots = torch.randperm(nb * bs, generator=g)[:t].to(device)
    kc, vc = torch.zeros(nb, bs, nkv, d, dtype=dtype, device=device), torch.zeros(nb, bs, nkv, d, dtype=dtype, device=device)
    kr, vr = kc.clone(), vc.clone()
    q, k = rope_and_cache(qkv, cs, slots, kc, vc, nh, nkv, d)
    qs, ks, vs = qkv.split([nh * d, nkv * d, nkv * d], -1)
    q_ref, k_ref = apply_rope(qs.reshape(t, nh, d), cs), apply_rope(ks.reshape(t, nkv, d), cs)
    write_kv(kr, vr, k_ref, vs.reshape(t, nkv, d), slots)
    for a, b in ((q, q_ref), (k, k_ref), (kc, kr), (vc, vr)):
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=atol)
    # silu(gate) * up
    gu = rnd(t, 2 * inter)
    ref = F.silu(gu[:, :inter].float()).to(dtype) * gu[:, inter:]
    torch.testing.assert_close(silu_mul(gu).float(), ref.float(), atol=atol, rtol=atol)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test covers the kernels")
def test_fused_ops_in_triton_interpreter() -> None:
    pytest.importorskip("triton")
    code = CASE + "\ncheck('cpu', torch.float32, 5, 64, 4, 2, 16, 172, 1e-5)\nprint('ok')\n"
    assert "ok" in interpreted(code)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize(
    "t, h, nh, nkv, d, inter",
    [
        (1, 2048, 32, 8, 64, 8192),
        (37, 4096, 32, 8, 128, 14336),
        (5, 64, 4, 2, 16, 172),
        (3, 896, 14, 2, 64, 4864),
    ],
)
def test_fused_ops_on_cuda(dtype, atol, t, h, nh, nkv, d, inter) -> None:
    ns: dict = {}
    exec(CASE, ns)
    ns["check"]("cuda", dtype, t, h, nh, nkv, d, inter, atol)
