"""Which rows and columns each rank holds (no processes)."""

from __future__ import annotations

import json

import pytest
import torch

from loraserve.inference_worker.config import WorkerConfig
from loraserve.inference_worker.lora.slots import LoRASlots
from loraserve.inference_worker.model.config import ModelConfig, ModelConfigError
from loraserve.inference_worker.parallel.shard import TensorShard, check_tensor_parallel
from tests.helpers.lora_payloads import payload_of, random_adapter


def config(**changes) -> ModelConfig:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 11,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 4,
    }
    return ModelConfig.from_dict({**raw, **changes})


def test_heads_and_vocabulary_split():
    cfg = config()
    r1 = TensorShard(1, 2)
    assert r1.out_ranges(cfg, "qkv") == [(8, 8), (16 + 4, 4), (16 + 8 + 4, 4)]
    assert r1.out_ranges(cfg, "gate_up") == [(12, 12), (36, 12)]
    assert r1.in_range(cfg, "o") == (8, 8) and r1.in_range(cfg, "down") == (12, 12)
    assert r1.out_ranges(cfg, "o") == [(0, 16)] and r1.in_range(cfg, "qkv") == (0, 16)
    assert r1.vocab(11) == (6, 6) and r1.vocab_loaded(11) == 5  # one padding row
    assert r1.checkpoint_slice(cfg, "model.layers.0.self_attn.o_proj.weight") == (1, (8, 8))
    assert r1.checkpoint_slice(cfg, "model.layers.0.self_attn.k_proj.bias") == (0, (4, 4))
    assert r1.checkpoint_slice(cfg, "model.norm.weight") is None


def test_fewer_kv_heads_than_ranks_are_replicated():
    cfg = config(num_key_value_heads=1)
    # ranks 0 and 1 share the KV head 0 (rows 16..20 of q|k|v), each with its own 2 q heads
    assert [TensorShard(r, 2).kv_heads(1) for r in (0, 1)] == [(0, 1), (0, 1)]
    assert TensorShard(1, 2).out_ranges(cfg, "qkv") == [(8, 8), (16, 4), (20, 4)]
    assert [TensorShard(r, 4).kv_heads(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]


def test_invariants_name_what_does_not_split():
    check_tensor_parallel(config(), 2)
    with pytest.raises(ModelConfigError, match="num_key_value_heads 2 neither divides"):
        check_tensor_parallel(config(num_attention_heads=12, intermediate_size=48), 3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be positive"):
        WorkerConfig(model="m", tensor_parallel_size=0)
    assert (
        WorkerConfig.from_args(["--model", "m"], {"LORASERVE_TENSOR_PARALLEL_SIZE": "2"}).tensor_parallel_size
        == 2
    )


def test_slot_shards_are_slices_of_the_whole_slot(tiny_model_dir):
    """The ranks' slots of one payload, put back together, are the single-process slot."""
    hf = json.loads((tiny_model_dir / "config.json").read_text())
    targets = {m: 4 for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
    payload = payload_of(random_adapter(hf, targets, seed=3), hf, "a")
    whole = LoRASlots(hf, 2, 8, torch.float32, "cpu")
    whole.load(1, payload)
    shards = [LoRASlots(hf, 2, 8, torch.float32, "cpu", TensorShard(r, 2)) for r in (0, 1)]
    for s in shards:
        s.load(1, payload)
        assert torch.equal(s.ranks, whole.ranks)
    cfg = ModelConfig.from_dict(hf)
    for group in ("qkv", "o", "gate_up", "down"):
        a, b = whole.a_all[group][:, 1], whole.b_all[group][:, 1]
        a_parts = [s.a_all[group][:, 1] for s in shards]
        b_parts = [s.b_all[group][:, 1] for s in shards]
        if group in ("o", "down"):  # A split by input columns, B whole
            assert torch.equal(torch.cat(a_parts, dim=-1), a)
            assert all(torch.equal(p, b) for p in b_parts)
        else:  # A whole, B split by output rows of each slice
            assert all(torch.equal(p, a) for p in a_parts)
            rows = [
                torch.cat([b[:, s : s + n] for s, n in TensorShard(r, 2).out_ranges(cfg, group)], 1)
                for r in (0, 1)
            ]
            assert all(torch.equal(p, w) for p, w in zip(b_parts, rows, strict=True))
            assert sum(p.shape[1] for p in b_parts) == b.shape[1]
