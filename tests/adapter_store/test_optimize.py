"""Fetched adapters equal the optimization math to the bit: B * alpha/r (or alpha/sqrt(r)), PEFT's
rank_pattern / alpha_pattern, q|k|v and gate|up packing with zero padding, the serving dtype."""

from __future__ import annotations

import hashlib
from pathlib import Path

import grpc
import pytest
import torch

from loraserve.clients.adapter_fetch import fetch_adapter
from loraserve.contract.adapter_layout import ALIGN
from loraserve.v1 import store_pb2, store_pb2_grpc
from tests.helpers.optimized_tensors import expected_tensors

_EXPECTED: dict[tuple[str, str], dict[str, torch.Tensor]] = {}


def _expected(base: Path, root: Path, name: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    key = (name, str(dtype))
    if key not in _EXPECTED:
        _EXPECTED[key] = expected_tensors(base, root / name, dtype)
    return _EXPECTED[key]


@pytest.mark.parametrize("name", ["peft-qv-r8", "peft-all-r16-rslora", "peft-patterns", "peft-subset-layer1"])
def test_fetched_tensors_equal_peft_math(name: str, stub, tiny_model_dir: Path, peft_root: Path) -> None:
    info = stub.RegisterAdapter(store_pb2.RegisterAdapterRequest(adapter_id=name, source=name))
    fetched = fetch_adapter(stub, name)
    expected = _expected(tiny_model_dir, peft_root, name, torch.bfloat16)
    assert list(fetched.tensors) == list(expected)  # layer, group order; lora_a before lora_b
    for tname, want in expected.items():
        got = fetched.tensors[tname]
        assert got.dtype == torch.bfloat16 and got.shape == want.shape, tname
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), tname
    assert fetched.digest == info.digest == hashlib.sha256(fetched.buffer.numpy()).hexdigest()
    assert info.rank == max(t.shape[-1] for n, t in expected.items() if n.endswith("lora_b"))
    assert all(t.offset % ALIGN == 0 for t in fetched.manifest.tensors)
    assert info.size_bytes == fetched.manifest.total_bytes == fetched.buffer.numel()


def test_patterns_and_subsets_are_recorded(stub) -> None:
    info = stub.RegisterAdapter(store_pb2.RegisterAdapterRequest(adapter_id="p", source="peft-patterns"))
    assert dict(info.rank_pattern) == {"v_proj": 4, "model.layers.1.mlp.down_proj": 2}
    assert dict(info.alpha_pattern) == {"o_proj": 4.0, "model.layers.0.self_attn.q_proj": 32.0}
    assert list(info.target_modules) == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    sub = stub.RegisterAdapter(store_pb2.RegisterAdapterRequest(adapter_id="s", source="peft-subset-layer1"))
    assert list(sub.target_modules) == ["k_proj", "up_proj"] and sub.rank == 4
    fetched = fetch_adapter(stub, "s")
    assert list(fetched.tensors) == [
        "layers.1.qkv.lora_a",
        "layers.1.qkv.lora_b",
        "layers.1.gate_up.lora_a",
        "layers.1.gate_up.lora_b",
    ]
    qkv_a = fetched.tensors["layers.1.qkv.lora_a"]  # [3, 4, 64]: only the k slice is non-zero
    assert qkv_a[0].abs().sum() == 0 and qkv_a[2].abs().sum() == 0 and qkv_a[1].abs().sum() > 0


def test_float32_serving_dtype(start_store, tiny_model_dir: Path, peft_root: Path) -> None:
    store = start_store(serving_dtype="float32")
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        info = stub.RegisterAdapter(
            store_pb2.RegisterAdapterRequest(adapter_id="f", source="peft-all-r16-rslora")
        )
        assert info.dtype == "float32" and info.use_rslora
        fetched = fetch_adapter(stub, "f")
    for tname, want in _expected(tiny_model_dir, peft_root, "peft-all-r16-rslora", torch.float32).items():
        assert torch.equal(fetched.tensors[tname], want), tname


def test_our_generator_writes_what_peft_loads(
    stub, make_demo, tiny_model_dir: Path, adapter_root: Path
) -> None:
    """Adapters from adapter_store.demo load in peft.PeftModel, and the store's output equals the
    math on what peft loaded (rsLoRA, a rank_pattern key by full module path, a layer subset)."""
    make_demo(
        "ours",
        r=8,
        lora_alpha=12,
        target_modules=("q_proj", "v_proj", "up_proj", "down_proj"),
        use_rslora=True,
        rank_pattern={"model.layers.1.mlp.down_proj": 2, "v_proj": 4},
        alpha_pattern={"up_proj": 3.0},
        layers=(1,),
        seed=9,
    )
    info = stub.RegisterAdapter(store_pb2.RegisterAdapterRequest(adapter_id="ours", source="ours"))
    assert info.rank == 8 and info.use_rslora
    fetched = fetch_adapter(stub, "ours")
    expected = expected_tensors(tiny_model_dir, adapter_root / "ours", torch.bfloat16)
    assert (
        list(fetched.tensors)
        == list(expected)
        == [
            "layers.1.qkv.lora_a",
            "layers.1.qkv.lora_b",
            "layers.1.gate_up.lora_a",
            "layers.1.gate_up.lora_b",
            "layers.1.down.lora_a",
            "layers.1.down.lora_b",
        ]
    )
    for name, want in expected.items():
        assert torch.equal(fetched.tensors[name].view(torch.int16), want.view(torch.int16)), name
    assert fetched.tensors["layers.1.down.lora_a"].shape == (1, 2, 172)
