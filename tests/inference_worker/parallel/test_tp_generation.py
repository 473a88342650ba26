"""A worker with tensor_parallel_size 2 (two processes over gloo, fp32 on CPU) generates the same
greedy tokens as one process, for the base model and several adapters in one batch, on the Llama,
Qwen2 (bias, tied embeddings) and single-KV-head shapes."""

from __future__ import annotations

import pytest

from loraserve.inference_worker.builder import build_worker
from loraserve.inference_worker.config import WorkerConfig
from loraserve.inference_worker.model.config import ModelConfigError
from tests.helpers.tensor_parallel import default_requests, generate, generate_in_process
from tests.inference_worker.parallel.conftest import needs_gloo

pytestmark = [needs_gloo, pytest.mark.slow, pytest.mark.timeout(180)]


def check_same_tokens(model_dir) -> None:
    requests = default_requests()
    want = generate(model_dir, 1, requests)
    got = generate_in_process(model_dir, 2, requests)
    assert got == want
    # the adapters change what is generated, so the comparison covers the sharded LoRA path
    same_prompt = [tuple(t) for r, t in zip(requests, want, strict=True) if r.prompt == requests[0].prompt]
    assert len(set(same_prompt)) == len(same_prompt)


def test_llama_tp2_matches_tp1(tiny_model_dir):
    check_same_tokens(tiny_model_dir)


def test_qwen2_tp2_matches_tp1(qwen2_model_dir):
    check_same_tokens(qwen2_model_dir)


def test_replicated_kv_head_tp2_matches_tp1(one_kv_head_model_dir):
    check_same_tokens(one_kv_head_model_dir)


def test_shape_that_does_not_split_is_refused_before_starting_ranks(tiny_model_dir):
    config = WorkerConfig(model=str(tiny_model_dir), device="cpu", tensor_parallel_size=3)
    with pytest.raises(
        ModelConfigError, match=r"num_attention_heads 4 is not divisible.*intermediate_size 172"
    ):
        build_worker(config)
