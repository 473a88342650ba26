"""The PEFT adapters of the worker's LoRA tests (made by the real `peft` library on the tiny model)
and a real adapter store (gRPC, SQLite registry) to register them in, with a handle on it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loraserve.contract.adapter_layout import MODULES

if TYPE_CHECKING:
    from loraserve.adapter_store.demo import DemoAdapterSpec
    from loraserve.adapter_store.server import BackgroundStore

# name -> make_peft_adapter keyword arguments: several ranks and target subsets, rsLoRA,
# rank_pattern / alpha_pattern, layers_to_transform.
ADAPTER_SPECS: dict[str, dict] = {
    "qv-r8": dict(r=8, lora_alpha=16.0, target_modules=("q_proj", "v_proj"), seed=1),
    "all-r4": dict(r=4, lora_alpha=8.0, target_modules=MODULES, seed=2),
    "mlp-rs16": dict(
        r=16, lora_alpha=32.0, target_modules=("gate_proj", "up_proj", "down_proj"), use_rslora=True, seed=3
    ),
    "patterned": dict(
        r=8,
        lora_alpha=16.0,
        target_modules=("q_proj", "k_proj", "o_proj", "down_proj"),
        rank_pattern={"k_proj": 2, "down_proj": 12},
        alpha_pattern={"o_proj": 4.0},
        seed=4,
    ),
    "attn-l1-r2": dict(
        r=2,
        lora_alpha=6.0,
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
        layers_to_transform=[1],
        seed=5,
    ),
}


@dataclass
class StoreHandle:
    store: BackgroundStore
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
            store_pb2.RegisterAdapterRequest(adapter_id=adapter_id, source=source, overwrite=overwrite),
            timeout=60,
        )

    def delete(self, adapter_id: str):
        from loraserve.v1 import store_pb2

        return self.stub().DeleteAdapter(store_pb2.DeleteAdapterRequest(adapter_id=adapter_id), timeout=30)


def start_lora_store(
    tiny_model_dir: Path, adapter_root: Path, data_dir: Path, port: int = 0, **extra
) -> StoreHandle:
    from loraserve.adapter_store.config import StoreConfig
    from loraserve.adapter_store.server import BackgroundStore

    config = StoreConfig(
        base_model=str(tiny_model_dir),
        port=port,
        data_dir=str(data_dir),
        adapter_root=str(adapter_root),
        serving_dtype="float32",
        log_level="WARNING",
        **extra,
    )
    bg = BackgroundStore(config)
    return StoreHandle(bg, bg.address, data_dir, bg.port)


def start_demo_store(model_dir: Path, specs: Sequence[DemoAdapterSpec], directory: Path) -> BackgroundStore:
    """The demo adapters `specs` written under directory/adapters, a store on port 0 with its data in
    directory/store, and every adapter registered under its name."""
    from loraserve.adapter_store.demo import write_demo_adapters
    from loraserve.clients.store_client import StoreClient

    write_demo_adapters(directory / "adapters", model_dir, specs)
    store = start_lora_store(model_dir, directory / "adapters", directory / "store").store
    with StoreClient(store.address) as client:
        for spec in specs:
            client.register(spec.name, spec.name)
    return store
