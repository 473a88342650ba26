"""The slot-shaped form of an adapter payload: what the worker keeps in its CPU tier, built once
per fetched payload (off the step thread) so that filling a GPU slot is a few strided copies.

Per module group the adapter targets, in GROUPS order, in the slots' dtype, each block starting
at a multiple of ALIGN bytes, then the ranks:

    A block  [num_layers, num_slices, r_g, in_features]   (the payload's, i.e. the whole model's dims)
    B block  [num_layers, out_total, r_g]
    ranks    int32 [num_layers, num_groups]                (the rank of each (layer, group); 0 = none)

r_g = the largest rank of the group over the layers. A layer of lower rank (or without the group)
is zero past its rank; the kernels read a slot's (layer, group) only up to its rank, so a slot
filled from this form computes exactly what the store's tensors would. Blocks of groups the
adapter never targets are absent (the slot's rank 0 keeps them unread).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

import torch

from loraserve.contract.adapter_layout import GROUPS, align


@dataclass(frozen=True)
class GroupBlock:
    group: str
    rank: int  # r_g
    num_slices: int
    in_features: int
    out_total: int
    a_offset: int  # bytes
    b_offset: int  # bytes


@dataclass(frozen=True)
class PackedLayout:
    dtype: torch.dtype
    num_layers: int
    blocks: tuple[GroupBlock, ...]
    ranks_offset: int  # bytes
    nbytes: int  # a multiple of ALIGN

    @staticmethod
    def plan(
        dtype: torch.dtype,
        num_layers: int,
        dims: dict[str, tuple[int, int, int]],
        group_ranks: dict[str, int],
    ) -> PackedLayout:
        """dims: group -> (num_slices, in_features, out_total); group_ranks: group -> r_g (>= 1),
        only the groups the adapter targets."""
        blocks, offset, size = [], 0, dtype.itemsize
        for g in GROUPS:
            r = group_ranks.get(g.name, 0)
            if r == 0:
                continue
            s, n_in, n_out = dims[g.name]
            a_offset = offset
            b_offset = align(a_offset + num_layers * s * r * n_in * size)
            offset = align(b_offset + num_layers * n_out * r * size)
            blocks.append(GroupBlock(g.name, r, s, n_in, n_out, a_offset, b_offset))
        nbytes = align(offset + num_layers * len(GROUPS) * 4)
        return PackedLayout(dtype, num_layers, tuple(blocks), offset, nbytes)

    def a_view(self, data: torch.Tensor, blk: GroupBlock) -> torch.Tensor:
        """[num_layers, num_slices, r_g, in] of `data` ([nbytes] uint8, this layout)."""
        n = self.num_layers * blk.num_slices * blk.rank * blk.in_features * self.dtype.itemsize
        return (
            data[blk.a_offset : blk.a_offset + n]
            .view(self.dtype)
            .view(self.num_layers, blk.num_slices, blk.rank, blk.in_features)
        )

    def b_view(self, data: torch.Tensor, blk: GroupBlock) -> torch.Tensor:
        """[num_layers, out_total, r_g] of `data`."""
        n = self.num_layers * blk.out_total * blk.rank * self.dtype.itemsize
        return (
            data[blk.b_offset : blk.b_offset + n]
            .view(self.dtype)
            .view(self.num_layers, blk.out_total, blk.rank)
        )

    def ranks_view(self, data: torch.Tensor) -> torch.Tensor:
        """int32 [num_layers, num_groups] of `data`."""
        n = self.num_layers * len(GROUPS) * 4
        return (
            data[self.ranks_offset : self.ranks_offset + n]
            .view(torch.int32)
            .view(self.num_layers, len(GROUPS))
        )

    def to_json(self) -> dict:
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "num_layers": self.num_layers,
            "blocks": [list(astuple(b)) for b in self.blocks],
            "ranks_offset": self.ranks_offset,
            "nbytes": self.nbytes,
        }

    @staticmethod
    def from_json(d: dict) -> PackedLayout:
        blocks = tuple(GroupBlock(*b) for b in d["blocks"])
        dtype = getattr(torch, d["dtype"])
        return PackedLayout(dtype, int(d["num_layers"]), blocks, int(d["ranks_offset"]), int(d["nbytes"]))
