"""The Triton paged-decode attention kernel against the plain-torch reference: on CUDA over dtypes
and shapes, and through Triton's interpreter on CPU (float32, tiny grids, in a subprocess so the
interpreter setting does not leak into other tests)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.interpreter import interpreted

CASE = r"""
import torch
from loraserve.inference_worker.model.attention import decode_attention_reference
from loraserve.inference_worker.model.decode_attention import paged_decode_attention

def check(device, dtype, nh, nkv, d, bs, lens, atol):
    g = torch.Generator(device="cpu").manual_seed(0)
    num_blocks = 1 + sum((n + bs - 1) // bs for n in lens) + 3
    k = torch.randn(num_blocks, bs, nkv, d, generator=g).to(device, dtype)
    v = torch.randn(num_blocks, bs, nkv, d, generator=g).to(device, dtype)
    q = torch.randn(len(lens), nh, d, generator=g).to(device, dtype)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    width = max((n + bs - 1) // bs for n in lens) + 2
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(lens):
        nb = (n + bs - 1) // bs
        table[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    table, cl = table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)
    out = paged_decode_attention(q, k, v, table, cl, d ** -0.5)
    ref = decode_attention_reference(q.float(), k.float(), v.float(), table, cl, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test covers the kernel")
def test_kernel_in_triton_interpreter() -> None:
    pytest.importorskip("triton")
    # as the interpreter's device has one multiprocessor, one part per 512 tokens; then as a small
    # batch on a GPU splits its contexts: five parts wanted
    code = CASE + (
        "\ncheck('cpu', torch.float32, 4, 2, 16, 16, [1, 17, 512, 513, 1600], 1e-4)"
        "\nfrom loraserve.inference_worker.model import decode_attention"
        "\ndecode_attention.parts_wanted = lambda programs, device: 5"
        "\ncheck('cpu', torch.float32, 4, 2, 16, 16, [1, 17, 64, 65, 513, 1600], 1e-4)\nprint('ok')\n"
    )
    assert "ok" in interpreted(code)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "dtype, atol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3), (torch.float32, 1e-4)]
)
@pytest.mark.parametrize(
    "nh, nkv, d, bs", [(32, 8, 64, 16), (32, 8, 128, 16), (14, 2, 64, 32), (8, 8, 128, 16)]
)
def test_kernel_on_cuda(dtype, atol, nh, nkv, d, bs) -> None:
    ns: dict = {}
    exec(CASE, ns)
    ns["check"]("cuda", dtype, nh, nkv, d, bs, [1, 5, 16, 17, 511, 512, 513, 1500, 64], atol)
