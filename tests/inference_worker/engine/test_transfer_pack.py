"""transfer.pack: the host half of StepInputs' one-copy transfer (its device half is tested on a GPU,
test_step_inputs_gpu.py)."""

from __future__ import annotations

import torch

from loraserve.inference_worker.engine.transfer import pack


def test_pack_lays_each_tensor_at_its_offset_byte_for_byte() -> None:
    tensors = [
        torch.tensor([-(2**40), 7, 2**62], dtype=torch.int64),
        torch.tensor([[1, -2, 3], [4, 5, -(2**31)]], dtype=torch.int32),
        torch.empty(0, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.tensor([0.5, -1.25], dtype=torch.float32),
    ]
    offsets = [0, 24, 48, 48, 56]
    host = torch.full((72,), 0xAB, dtype=torch.uint8)
    pack(host, tensors, offsets)
    for t, off in zip(tensors, offsets, strict=True):
        n = t.numel() * t.element_size()
        assert torch.equal(host[off : off + n].view(t.dtype).view(t.shape), t)
    assert host[51:56].tolist() == [0xAB] * 5  # bytes between tensors untouched
    assert host[64:].tolist() == [0xAB] * 8


def test_pack_takes_views_and_empty_shapes() -> None:
    base = torch.arange(12, dtype=torch.int64).view(3, 4)
    tensors = [base[:, :2], torch.empty((2, 0), dtype=torch.int32), torch.tensor(7, dtype=torch.int64)]
    host = torch.zeros(56, dtype=torch.uint8)
    pack(host, tensors, [0, 48, 48])
    assert host[:48].view(torch.int64).tolist() == [0, 1, 4, 5, 8, 9]
    assert host[48:].view(torch.int64).tolist() == [7]
