"""Fixtures of the worker tests: real workers (grpc.aio on port 0 in a background loop) on the
tiny model, PEFT adapters for the LoRA tests and a real store holding them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.lora_store import ADAPTER_SPECS, start_lora_store
from tests.helpers.peft_adapters import make_peft_adapter
from tests.helpers.ports import free_port
from tests.helpers.workers import worker_config

# grpc and the stubs are imported inside the fixtures: the model/engine tests also run on GPU
# machines whose grpc may not match the generated stubs.


@pytest.fixture
def start_worker(tiny_model_dir: Path):
    """start_worker(**config overrides) -> BackgroundWorker; stopped at teardown."""
    from loraserve.inference_worker.server import BackgroundWorker

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
    from loraserve.inference_worker.server import BackgroundWorker

    bg = BackgroundWorker(worker_config(tiny_model_dir))
    yield bg
    bg.stop()


@pytest.fixture(scope="session")
def lora_adapter_root(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of PEFT checkpoints: ADAPTER_SPECS, plus 'alt-*' variants used to re-register
    an adapter with new weights."""
    root = tmp_path_factory.mktemp("adapters")
    for name, spec in ADAPTER_SPECS.items():
        make_peft_adapter(tiny_model_dir, root / name, **spec)
    make_peft_adapter(
        tiny_model_dir,
        root / "alt-qv-r8",
        r=8,
        lora_alpha=16.0,
        target_modules=("q_proj", "v_proj"),
        seed=101,
    )
    return root


@pytest.fixture(scope="module")
def lora_store(tiny_model_dir: Path, lora_adapter_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real store with every ADAPTER_SPECS adapter registered under its name."""
    handle = start_lora_store(
        tiny_model_dir, lora_adapter_root, tmp_path_factory.mktemp("store"), port=free_port()
    )
    for name in ADAPTER_SPECS:
        handle.register(name, name)
    yield handle
    handle.store.stop()
