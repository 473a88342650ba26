"""Fixtures of the tensor-parallel tests: tiny checkpoints of the shapes TP must handle, and a skip
where torch.distributed has no gloo backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from loraserve.inference_worker.model.tiny import TinyLlamaSpec, write_tiny_llama

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed has no gloo backend"
)


@pytest.fixture(scope="session")
def qwen2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen2 shape: q/k/v bias and tied embeddings."""
    spec = TinyLlamaSpec(tie_word_embeddings=True, attention_bias=True, seed=5, name="tiny-qwen2")
    d = write_tiny_llama(tmp_path_factory.mktemp("tiny-qwen2"), spec)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="session")
def one_kv_head_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GQA with a single KV head: with 2 ranks it is replicated on both."""
    spec = TinyLlamaSpec(num_key_value_heads=1, seed=7, name="tiny-mqa")
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-mqa"), spec)
