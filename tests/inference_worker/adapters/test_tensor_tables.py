"""A fetched manifest's tensor table: built once per layout, each payload keeps its own adapter
id, digest and rank (the worker's event loop parses one per fetch)."""

from __future__ import annotations

import torch

from loraserve.contract.payload import PayloadTensor
from loraserve.inference_worker.adapters.store_source import TensorTables
from loraserve.v1 import store_pb2


def manifest(adapter_id: str, digest: str, rank: int, layers: int = 3) -> bytes:
    m = store_pb2.AdapterManifest(digest=digest, rank=rank, total_bytes=layers * 2 * 4096, layout_version=1)
    m.adapter.adapter_id = adapter_id
    offset = 0
    for layer in range(layers):
        for which, shape in (("lora_a", [1, rank, 64]), ("lora_b", [64, rank])):
            nbytes = 2 * rank * 64
            m.tensors.add(
                name=f"layers.{layer}.o.{which}", shape=shape, dtype="bfloat16", offset=offset, nbytes=nbytes
            )
            offset += nbytes
    return m.SerializeToString()


def test_one_layout_is_built_once_and_each_payload_keeps_its_own_identity():
    tables, buf = TensorTables(), torch.empty(0, dtype=torch.uint8)
    a = tables.payload(manifest("a", "1" * 64, 8), buf, "a")
    b = tables.payload(manifest("b", "2" * 64, 8), buf, "b")
    assert (a.adapter_id, a.digest, a.rank) == ("a", "1" * 64, 8)
    assert (b.adapter_id, b.digest, b.rank) == ("b", "2" * 64, 8)
    assert a.tensors == b.tensors and all(x is y for x, y in zip(a.tensors, b.tensors, strict=True))
    assert a.tensors is not b.tensors  # each payload has its own list
    assert a.tensors[1] == PayloadTensor("layers.0.o.lora_b", (64, 8), "bfloat16", 1024, 1024)


def test_handed_over_payloads_of_one_layout_share_its_table():
    """A hand-over's manifest names its file (the digest): the layout is still the tensors alone.
    Keyed with the name, every fetch built its table anew and pushed another out of the cache, a
    stream of young objects kept alive for a while, which the garbage collector walked."""
    tables, buf = TensorTables(), torch.empty(0, dtype=torch.uint8)
    payloads = []
    for i in range(3):
        m = store_pb2.AdapterManifest.FromString(manifest(f"a{i}", str(i) * 64, 8))
        m.handover_file = m.digest
        payloads.append(tables.payload(m.SerializeToString(), buf, f"a{i}"))
    assert len(tables._tables) == 1
    # a field added to the manifest must be cleared from the key as well (TensorTables.payload)
    every = {f.name for f in store_pb2.AdapterManifest.DESCRIPTOR.fields}
    assert every == {"adapter", "total_bytes", "digest", "layout_version", "rank", "handover_file", "tensors"}
    assert all(x is y for p in payloads[1:] for x, y in zip(p.tensors, payloads[0].tensors, strict=True))


def test_another_layout_gets_its_own_table_and_old_ones_go():
    tables, buf = TensorTables(), torch.empty(0, dtype=torch.uint8)
    r8 = tables.payload(manifest("a", "1" * 64, 8), buf, "a")
    r16 = tables.payload(manifest("a", "3" * 64, 16), buf, "a")
    assert r16.tensors != r8.tensors and r16.tensors[0].shape == (1, 16, 64)
    deeper = tables.payload(manifest("c", "4" * 64, 8, layers=4), buf, "c")
    assert len(deeper.tensors) == 8 and deeper.tensors[:6] == r8.tensors
    tables.TABLES = 2
    tables.payload(manifest("d", "5" * 64, 4), buf, "d")
    assert len(tables._tables) == 2  # the least recently used layout left
    again = tables.payload(manifest("a", "6" * 64, 8), buf, "a")
    assert again.tensors == r8.tensors and again.tensors[0] is not r8.tensors[0]  # built anew


def test_an_adapter_id_missing_from_the_manifest_is_the_one_asked_for():
    m = store_pb2.AdapterManifest.FromString(manifest("", "7" * 64, 8))
    got = TensorTables().payload(m.SerializeToString(), torch.empty(0, dtype=torch.uint8), "asked")
    assert got.adapter_id == "asked"
