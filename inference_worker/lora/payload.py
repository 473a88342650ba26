"""An optimized adapter payload held by the worker (docs/adapter-layout.md): one flat byte
buffer — pinned when CUDA is present — plus the manifest's tensor table."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import torch

from loraserve.contract.payload import TORCH_DTYPES, PayloadTensor

_NAME = re.compile(r"layers\.(\d+)\.(qkv|o|gate_up|down)\.(lora_a|lora_b)")


def parse_name(t: PayloadTensor) -> tuple[int, str, str]:
    """(layer, group, which) of the tensor's name; ValueError for a name outside the layout."""
    m = _NAME.fullmatch(t.name)
    if m is None:
        raise ValueError(f"tensor {t.name!r} is not part of the adapter layout")
    return int(m.group(1)), m.group(2), m.group(3)


def torch_dtype(t: PayloadTensor) -> torch.dtype:
    """The tensor's torch dtype; ValueError for a dtype outside the layout."""
    try:
        return TORCH_DTYPES[t.dtype]
    except KeyError:
        raise ValueError(f"tensor {t.name!r} has unsupported dtype {t.dtype!r}") from None


@dataclass
class AdapterPayload:
    adapter_id: str
    digest: str
    rank: int
    data: torch.Tensor  # [total_bytes] uint8, contiguous (pinned on CUDA hosts)
    tensors: list[PayloadTensor]
    copy_plan: list | None = field(default=None, repr=False, compare=False)  # LoRASlots' cache
    # how a store fetch brought it: "stream", "file" (handed over on the store's host) or "missed"
    # (a hand-over file this worker could not read, then streamed); "" when not from the store
    transport: str = field(default="", compare=False)

    @functools.cached_property
    def pinned(self) -> bool:
        """Whether `data` is in pinned memory (asked once: each torch call on the step thread is a
        point where another thread may take the interpreter)."""
        return bool(self.data.is_pinned())

    @property
    def key(self) -> str:
        return f"{self.adapter_id}@{self.digest}"

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def view(self, t: PayloadTensor, data: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor `t` as a typed view into `data` (default: this payload's bytes)."""
        buf = self.data if data is None else data
        return buf[t.offset : t.offset + t.nbytes].view(torch_dtype(t)).view(t.shape)
