"""Pre-optimization: a validated PEFT adapter -> the optimized payload of layout v1.

For each layer and each module group the adapter touches (loraserve/contract/adapter_layout.py):
    lora_a : [num_slices, r_g, in]   slice i rows [:r_i] = A_i, the rest zero
    lora_b : [out_total, r_g]        rows of slice i, columns [:r_i] = B_i * scale_i (fp32), rest zero
then cast to the serving dtype and written at 64-byte aligned offsets into one uint8 buffer
(pinned when CUDA is present) whose sha256 is the adapter's digest.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from loraserve.adapter_store.errors import InvalidArgument
from loraserve.adapter_store.validate import LoraAdapter
from loraserve.contract.adapter_layout import GROUPS, LAYOUT_VERSION, align, group_dims, tensor_name
from loraserve.contract.payload import TORCH_DTYPES, PayloadTensor, tensor_view


@dataclass
class OptimizedAdapter:
    tensors: list[PayloadTensor]
    payload: torch.Tensor  # [total_bytes] uint8, pinned when CUDA is available
    digest: str  # hex sha256 of payload
    rank: int
    dtype: str
    layout_version: int = LAYOUT_VERSION

    @property
    def total_bytes(self) -> int:
        return int(self.payload.numel())

    def tensor(self, name: str) -> torch.Tensor:
        e = next(t for t in self.tensors if t.name == name)
        return tensor_view(self.payload, e)


def _layout(adapter: LoraAdapter, base_config: dict, dtype: str) -> list[tuple[PayloadTensor, tuple]]:
    """Payload entries in order, each with what fills it: ("a"|"b", group, [module or None per slice], ...)."""
    itemsize = TORCH_DTYPES[dtype].itemsize
    plan: list[tuple[PayloadTensor, tuple]] = []
    offset = 0
    for layer in sorted({layer for layer, _ in adapter.modules}):
        for group in GROUPS:
            mods = [adapter.modules.get((layer, m)) for m in group.slices]
            if not any(mods):
                continue
            in_f, outs = group_dims(base_config, group)
            r_g = max(m.r for m in mods if m is not None)
            for which, shape in (("lora_a", (len(group.slices), r_g, in_f)), ("lora_b", (sum(outs), r_g))):
                nbytes = math.prod(shape) * itemsize
                entry = PayloadTensor(tensor_name(layer, group.name, which), shape, dtype, offset, nbytes)
                plan.append((entry, (which, mods, outs)))
                offset = align(offset + nbytes)
    return plan


def optimize(adapter: LoraAdapter, base_config: dict, dtype: str = "bfloat16") -> OptimizedAdapter:
    """Write every tensor straight into its place in a zeroed payload (the zeros are the padding of
    lower-rank and untargeted slices); B is scaled in float32, then cast to the serving dtype."""
    plan = _layout(adapter, base_config, dtype)
    total = plan[-1][0].offset + plan[-1][0].nbytes if plan else 0
    payload = torch.zeros(total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    for entry, (which, mods, outs) in plan:
        dst = tensor_view(payload, entry)
        row = 0
        for i, (m, n) in enumerate(zip(mods, outs, strict=True)):
            if m is not None:
                if which == "lora_a":
                    dst[i, : m.r] = m.a  # [r, in], cast on copy
                else:
                    dst[row : row + n, : m.r] = m.b.to(torch.float32) * m.scale  # [out, r]
            row += n
        if not bool(torch.isfinite(dst).all()):
            # the inputs were finite: scaling (alpha / r) or the cast to the serving dtype overflowed
            raise InvalidArgument(
                f"tensor {entry.name}: lora_alpha={adapter.lora_alpha:g} scaling or the cast to "
                f"{dtype} overflows (values beyond the serving dtype's range)"
            )
    digest = hashlib.sha256(memoryview(payload.numpy())).hexdigest()  # type: ignore[arg-type]
    return OptimizedAdapter([e for e, _ in plan], payload, digest, adapter.rank, dtype)
