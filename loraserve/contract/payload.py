"""The optimized adapter payload as torch sees it (docs/adapter-layout.md): one flat uint8 buffer
plus a table of entries, each a typed tensor at a 64-byte aligned offset."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


@dataclass(frozen=True)
class PayloadTensor:
    name: str  # layers.{L}.{group}.{lora_a|lora_b}
    shape: tuple[int, ...]
    dtype: str
    offset: int  # bytes into the payload
    nbytes: int


class PayloadEntry(Protocol):
    """A PayloadTensor or a manifest's TensorEntry."""

    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...


def tensor_view(buf: torch.Tensor, entry: PayloadEntry) -> torch.Tensor:
    """The entry as a typed view of buf[offset:offset + nbytes] (buf: [total_bytes] uint8, no copy)."""
    return (
        buf[entry.offset : entry.offset + entry.nbytes]
        .view(TORCH_DTYPES[entry.dtype])
        .view(tuple(entry.shape))
    )
