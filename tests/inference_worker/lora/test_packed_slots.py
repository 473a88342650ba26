"""Slots filled from the packed payload hold bit for bit what a per-tensor copy of the store's
tensors puts there (mixed ranks across layers and groups, groups absent from some layers, a dtype
conversion, tensor-parallel shards), with one copy per (group, A|B) plus the ranks."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loraserve.adapter_store.validate import LoraAdapter, LoraModule, scale_of
from loraserve.contract.adapter_layout import GROUPS, module_shapes
from loraserve.inference_worker.lora import AdapterPayload, LoRASlots
from loraserve.inference_worker.lora.payload import parse_name
from loraserve.inference_worker.lora.slots import GROUP_INDEX, row_runs
from loraserve.inference_worker.model.config import ModelConfig
from loraserve.inference_worker.parallel.shard import TensorShard
from tests.helpers.lora_payloads import payload_of

# layer -> module -> rank: ranks differ across layers and groups; some groups skip layers
MIXED = {
    0: {"q_proj": 4, "v_proj": 8, "o_proj": 2, "down_proj": 16},
    1: {"q_proj": 8, "k_proj": 8, "gate_proj": 3},
    2: {"v_proj": 1, "o_proj": 2, "up_proj": 5, "down_proj": 4},
    3: {"q_proj": 8, "k_proj": 2, "v_proj": 8, "o_proj": 6, "gate_proj": 5, "up_proj": 5, "down_proj": 16},
}


@pytest.fixture(scope="module")
def config4(config: dict) -> dict:
    return {**config, "num_hidden_layers": 4}


def adapter_of(config: dict, ranks: dict[int, dict[str, int]], seed: int) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    mods = {}
    for layer, targets in ranks.items():
        for m, r in targets.items():
            n_in, n_out = shapes[m]
            a, b = torch.randn(r, n_in, generator=g), torch.randn(n_out, r, generator=g)
            mods[(layer, m)] = LoraModule(layer, m, r, 2.0 * r, scale_of(2.0 * r, r, False), a, b)
    return LoraAdapter(mods, max(max(t.values()) for t in ranks.values()), 16.0, False)


def reference_load(slots: LoRASlots, slot: int, payload: AdapterPayload) -> None:
    """The straightforward copy: every store tensor on its own, this rank's part of it."""
    slots.ranks[:, :, slot] = 0
    for t in payload.tensors:
        layer, group, which = parse_name(t)
        src = payload.view(t).to(slots.dtype)
        r = t.shape[1]
        rows, (c0, nc) = (
            slots.shard_ranges[group]
            if slots.shard_ranges is not None
            else ([(0, slots.payload_out[group])], (0, slots.payload_in[group]))
        )
        if which == "lora_a":
            slots.a_all[group][layer, slot, :, :r] = src[..., c0 : c0 + nc]
            slots.ranks[layer, GROUP_INDEX[group], slot] = r
        else:
            slots.b_all[group][layer, slot, :, :r] = torch.cat([src[r0 : r0 + n] for r0, n in rows])


def read_regions(slots: LoRASlots, slot: int) -> list[torch.Tensor]:
    """What the kernels read of a slot: each (layer, group) up to its rank, and the ranks."""
    out = [slots.ranks[:, :, slot].clone()]
    for layer in range(slots.num_layers):
        for g in GROUPS:
            r = int(slots.ranks[layer, GROUP_INDEX[g.name], slot])
            out += [slots.a[layer][g.name][slot, :, :r].clone(), slots.b[layer][g.name][slot, :, :r].clone()]
    return out


def assert_same_bits(x: list[torch.Tensor], y: list[torch.Tensor]) -> None:
    assert len(x) == len(y)
    for a, b in zip(x, y, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(
            a.view(torch.uint8) if a.dtype != torch.int32 else a,
            b.view(torch.uint8) if b.dtype != torch.int32 else b,
        )


SHARDS = [None, TensorShard(0, 2), TensorShard(1, 2), TensorShard(1, 4), TensorShard(3, 4)]


@pytest.mark.parametrize("shard", SHARDS, ids=lambda s: "whole" if s is None else f"tp{s.rank}of{s.size}")
@pytest.mark.parametrize(
    "store_dtype,dtype",
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float32", torch.bfloat16)],
)
def test_packed_copy_is_bit_identical_to_per_tensor_copy(config4, shard, store_dtype, dtype) -> None:
    payload = payload_of(adapter_of(config4, MIXED, seed=1), config4, "mixed", store_dtype)
    previous = payload_of(
        adapter_of(
            config4, {layer: {"q_proj": 16, "o_proj": 16, "down_proj": 16} for layer in range(4)}, seed=2
        ),
        config4,
        "prev",
        store_dtype,
    )
    fast = LoRASlots(config4, max_loras=3, max_rank=16, dtype=dtype, device="cpu", shard=shard)
    ref = LoRASlots(config4, max_loras=3, max_rank=16, dtype=dtype, device="cpu", shard=shard)
    packed = fast.pack(payload)
    assert packed.packed is not None and packed.data.numel() == packed.packed.nbytes
    fast.load(1, packed)
    reference_load(ref, 1, payload)
    # fresh buffers: the padding past a layer's rank is zero in both, so every byte agrees
    for a, b in zip(
        (*fast.a_all.values(), *fast.b_all.values(), fast.ranks),
        (*ref.a_all.values(), *ref.b_all.values(), ref.ranks),
        strict=True,
    ):
        assert torch.equal(a, b)
    # over a previous adapter of higher ranks: what the kernels read agrees
    fast.load(2, previous)
    reference_load(ref, 2, previous)
    fast.load(2, packed)
    reference_load(ref, 2, payload)
    assert_same_bits(read_regions(fast, 2), read_regions(ref, 2))
    # the store-layout payload loads the same (packed once, kept on it)
    fast.load(0, payload)
    assert payload.slot_form is not None
    assert_same_bits(read_regions(fast, 0), read_regions(ref, 1))


class CopyCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.copies += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shard", [None, TensorShard(1, 2)], ids=["whole", "tp1of2"])
def test_one_copy_per_group_and_matrix(config4, shard) -> None:
    slots = LoRASlots(config4, max_loras=2, max_rank=16, dtype=torch.float32, device="cpu", shard=shard)
    packed = slots.pack(payload_of(adapter_of(config4, MIXED, seed=3), config4, "mixed"))
    with CopyCount() as count:
        slots.load(0, packed)
    # 4 groups x (A, B) + ranks; sharded, B of qkv is q | k,v (2 copies) and gate|up one copy
    extra = 0 if shard is None else 1
    assert count.copies == 2 * len(GROUPS) + 1 + extra


def test_groups_never_targeted_take_no_room_and_no_copy(config4) -> None:
    slots = LoRASlots(config4, max_loras=2, max_rank=16, dtype=torch.float32, device="cpu")
    packed = slots.pack(
        payload_of(adapter_of(config4, {1: {"o_proj": 4}, 3: {"o_proj": 2}}, seed=4), config4, "o")
    )
    assert packed.packed is not None and [b.group for b in packed.packed.blocks] == ["o"]
    with CopyCount() as count:
        slots.load(1, packed)
    assert count.copies == 3
    assert slots.ranks[:, GROUP_INDEX["o"], 1].tolist() == [0, 4, 0, 2]


def test_row_runs_merge_equal_evenly_spaced_ranges(config4) -> None:
    cfg = ModelConfig.from_dict(config4)
    rows = TensorShard(1, 2).out_ranges(cfg, "gate_up")
    assert len(row_runs(rows)) == 1
    assert row_runs([(0, 4), (10, 2), (20, 2), (30, 2), (41, 2)]) == [
        (0, 4, 1, 0),
        (10, 2, 3, 10),
        (41, 2, 1, 0),
    ]
