"""Fixtures of the worker's LoRA tests: PEFT adapters made by the real `peft` library on the tiny
model, a real adapter store (gRPC on a free port, SQLite registry) to register them in."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from clients.adapter_layout import MODULES
from tests.conftest import free_port
from tests.helpers.peft_adapters import make_peft_adapter

# name -> make_peft_adapter keyword arguments: several ranks and target subsets, rsLoRA,
# rank_pattern / alpha_pattern, layers_to_transform.
ADAPTER_SPECS: dict[str, dict] = {
    "qv-r8": dict(r=8, lora_alpha=16.0, target_modules=("q_proj", "v_proj"), seed=1),
    "all-r4": dict(r=4, lora_alpha=8.0, target_modules=MODULES, seed=2),
    "mlp-rs16": dict(r=16, lora_alpha=32.0, target_modules=("gate_proj", "up_proj", "down_proj"),
                     use_rslora=True, seed=3),
    "patterned": dict(r=8, lora_alpha=16.0, target_modules=("q_proj", "k_proj", "o_proj", "down_proj"),
                      rank_pattern={"k_proj": 2, "down_proj": 12}, alpha_pattern={"o_proj": 4.0}, seed=4),
    "attn-l1-r2": dict(r=2, lora_alpha=6.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
                       layers_to_transform=[1], seed=5),
}


@pytest.fixture(scope="session")
def adapter_root(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of PEFT checkpoints: ADAPTER_SPECS, plus 'alt-*' variants used to re-register
    an adapter with new weights."""
    root = tmp_path_factory.mktemp("adapters")
    for name, spec in ADAPTER_SPECS.items():
        make_peft_adapter(tiny_model_dir, root / name, **spec)
    make_peft_adapter(tiny_model_dir, root / "alt-qv-r8", r=8, lora_alpha=16.0,
                      target_modules=("q_proj", "v_proj"), seed=101)
    return root


@dataclass
class StoreHandle:
    store: object  # adapter_store.server.BackgroundStore
    address: str
    data_dir: Path
    port: int

    def stub(self):
        import grpc
        from loraserve.v1 import store_pb2_grpc

        return store_pb2_grpc.AdapterStoreStub(grpc.insecure_channel(self.address))

    def register(self, adapter_id: str, source: str, overwrite: bool = False):
        from loraserve.v1 import store_pb2

        return self.stub().RegisterAdapter(
            store_pb2.RegisterAdapterRequest(adapter_id=adapter_id, source=source, overwrite=overwrite), timeout=60)

    def delete(self, adapter_id: str):
        from loraserve.v1 import store_pb2

        return self.stub().DeleteAdapter(store_pb2.DeleteAdapterRequest(adapter_id=adapter_id), timeout=30)


def start_store(tiny_model_dir: Path, adapter_root: Path, data_dir: Path, port: int = 0, **extra) -> StoreHandle:
    from adapter_store.config import StoreConfig
    from adapter_store.server import BackgroundStore

    config = StoreConfig(base_model=str(tiny_model_dir), port=port, data_dir=str(data_dir),
                         adapter_root=str(adapter_root), serving_dtype="float32", log_level="WARNING", **extra)
    bg = BackgroundStore(config)
    return StoreHandle(bg, bg.address, data_dir, bg.port)


@pytest.fixture(scope="module")
def store(tiny_model_dir: Path, adapter_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real store with every ADAPTER_SPECS adapter registered under its name."""
    handle = start_store(tiny_model_dir, adapter_root, tmp_path_factory.mktemp("store"), port=free_port())
    for name in ADAPTER_SPECS:
        handle.register(name, name)
    yield handle
    handle.store.stop()


def peft_reference(base_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], max_new_tokens: int):
    """(greedy tokens up to EOS, raw logits of the first generated position [V]) from
    transformers + peft."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    eos = model.config.eos_token_id
    if eos in tokens:
        tokens = tokens[: tokens.index(eos)]
    return tokens, out.logits[0][0].float()


class LocalWorker:
    """The engine with LoRA, in-process: the step thread plus an asyncio loop thread for fetches
    (what the worker's server wires up, minus gRPC)."""

    def __init__(self, model_dir: Path, store_address: str, *, max_loras: int = 4, max_cpu_loras: int = 8,
                 max_cpu_bytes: int = 1 << 30, max_num_seqs: int = 16, poll_interval_s: float = 0.2,
                 start_engine: bool = True) -> None:
        import asyncio
        import threading

        import torch

        from inference_worker.adapters import WorkerAdapters
        from inference_worker.adapters.store_source import StoreSource
        from inference_worker.engine.engine import EngineConfig, LLMEngine
        from inference_worker.model.loader import load_model, load_tokenizer

        model = load_model(model_dir, torch.float32, "cpu")
        cfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=256, max_num_batched_tokens=256,
                           num_blocks=256, use_cuda_graphs=False)
        self.adapters = WorkerAdapters.create(
            model.config.raw, max_loras=max_loras, max_lora_rank=64, max_cpu_loras=max_cpu_loras,
            max_cpu_bytes=max_cpu_bytes, dtype=torch.float32, device="cpu", max_tokens=cfg.max_num_batched_tokens,
            source=StoreSource(store_address, timeout_s=10, max_retries=1), poll_interval_s=poll_interval_s)
        self.adapters.attach_model(model)
        self.engine = LLMEngine(model, load_tokenizer(model_dir), cfg, self.adapters)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.adapters.attach(self.engine, self.loop)
        if start_engine:  # else the test drives the engine's parts on its own thread
            self.engine.start()
        self._n = 0

    def call(self, coro, timeout: float = 60):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, prompt_ids: list[int], adapter_id: str = "", max_tokens: int = 8):
        """-> a concurrent future of (tokens, error, final output)."""
        import concurrent.futures

        from inference_worker.engine.sequence import SamplingParams

        fut: concurrent.futures.Future = concurrent.futures.Future()
        tokens: list[int] = []

        def on_output(out) -> None:
            tokens.extend(out.token_ids)
            if out.finished:
                fut.set_result((tokens, out.error, out))

        self._n += 1
        seq = self.engine.make_sequence(f"r{self._n}", "", prompt_ids, SamplingParams(max_tokens=max_tokens),
                                        on_output, adapter_id)
        self.engine.submit(seq)
        return fut

    def generate(self, prompt_ids: list[int], adapter_id: str = "", max_tokens: int = 8, timeout: float = 60):
        return self.submit(prompt_ids, adapter_id, max_tokens).result(timeout)

    def close(self) -> None:
        self.engine.shutdown()
        self.call(self.adapters.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
