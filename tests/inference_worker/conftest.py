"""Fixtures of the worker tests: real workers (grpc.aio on port 0 in a background loop) on the
tiny model, and engines driven step by step on the test's thread."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference_worker.config import WorkerConfig
from inference_worker.engine.engine import EngineConfig, LLMEngine
from inference_worker.model.loader import load_model, load_tokenizer

# grpc and the stubs are imported inside the fixtures: the model/engine tests also run on GPU
# machines whose grpc may not match the generated stubs.


def worker_config(model_dir: Path, **overrides) -> WorkerConfig:
    base = dict(model=str(model_dir), port=0, device="cpu", dtype="float32", max_num_seqs=8,
                max_num_batched_tokens=32, num_kv_blocks=128, max_queue_size=64, log_level="WARNING")
    return WorkerConfig(**{**base, **overrides})


@pytest.fixture
def start_worker(tiny_model_dir: Path):
    """start_worker(**config overrides) -> BackgroundWorker; stopped at teardown."""
    from inference_worker.server import BackgroundWorker

    started: list[BackgroundWorker] = []

    def start(**overrides) -> BackgroundWorker:
        bg = BackgroundWorker(worker_config(tiny_model_dir, **overrides))
        started.append(bg)
        return bg

    yield start
    for bg in started:
        bg.stop()


@pytest.fixture(scope="module")
def worker(tiny_model_dir: Path):
    """A shared worker for tests that leave it as they found it."""
    from inference_worker.server import BackgroundWorker

    bg = BackgroundWorker(worker_config(tiny_model_dir))
    yield bg
    bg.stop()


def stub_for(address: str):
    import grpc
    from loraserve.v1 import worker_pb2_grpc

    return worker_pb2_grpc.InferenceWorkerStub(grpc.insecure_channel(address))


def make_engine(model_dir: Path, **overrides) -> LLMEngine:
    cfg = EngineConfig(**{**dict(max_num_seqs=8, max_model_len=512, max_num_batched_tokens=32, num_blocks=64,
                                 use_cuda_graphs=False), **overrides})
    return LLMEngine(load_model(model_dir, torch.float32, "cpu"), load_tokenizer(model_dir), cfg)
