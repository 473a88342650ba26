"""Worker set-ups the worker tests share: a small CPU configuration, a stub on an address, and an
engine driven step by step on the test's thread. grpc and the stubs are imported inside: the
model/engine tests also run on GPU machines whose grpc may not match the generated stubs."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch

from loraserve.contract.streaming import message_ends
from loraserve.inference_worker.config import WorkerConfig
from loraserve.inference_worker.engine.engine import EngineConfig, LLMEngine
from loraserve.inference_worker.model.chat_template import ChatTemplate
from loraserve.inference_worker.model.loader import load_model, load_tokenizer


def worker_config(model_dir: Path, **overrides) -> WorkerConfig:
    base = dict(
        model=str(model_dir),
        port=0,
        device="cpu",
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=32,
        num_kv_blocks=128,
        max_queue_size=64,
        log_level="WARNING",
    )
    return WorkerConfig(**{**base, **overrides})


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll `predicate` every `interval` seconds until it holds or `timeout` seconds pass; its last
    answer."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def stream_sizes(num_tokens: int, every: int) -> list[int]:
    """Tokens per message (engine output) of a streamed completion of `num_tokens` that ends at its
    length or a stop string, at stream interval `every`: the first alone, then `every` a message,
    what is left with the ending; 1 + ceil((num_tokens - 1) / every) messages (0 counts as 1)."""
    ends = message_ends(num_tokens, every)
    return [b - a for a, b in itertools.pairwise([0, *ends])]


def stub_for(address: str):
    import grpc

    from loraserve.v1 import worker_pb2_grpc

    return worker_pb2_grpc.InferenceWorkerStub(grpc.insecure_channel(address))


def make_engine(model_dir: Path, device: str = "cpu", **overrides) -> LLMEngine:
    cfg = EngineConfig(
        **{
            **dict(
                max_num_seqs=8,
                max_model_len=512,
                max_num_batched_tokens=32,
                num_blocks=64,
                use_cuda_graphs=False,
            ),
            **overrides,
        }
    )
    tokenizer = load_tokenizer(model_dir)
    return LLMEngine(
        load_model(model_dir, torch.float32, device),
        tokenizer,
        cfg,
        chat=ChatTemplate.from_dir(model_dir, tokenizer),
    )
