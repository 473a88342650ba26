"""Store fixtures shared by the store, client and contract tests (a pytest plugin of the root
conftest): PEFT adapters built once per session, an adapter root holding them, and stores running
on real grpc.aio servers on port 0. grpc and the services are imported inside the fixtures: the
model and kernel tests also run on GPU machines whose grpc may not match the generated stubs."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from loraserve.contract.adapter_layout import MODULES
from tests.helpers.peft_adapters import make_peft_adapter

if TYPE_CHECKING:
    from loraserve.adapter_store.config import StoreConfig
    from loraserve.adapter_store.server import BackgroundStore

# name -> make_peft_adapter keyword arguments
PEFT_ADAPTERS: dict[str, dict] = {
    "peft-qv-r8": dict(r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"), seed=1),
    "peft-all-r16-rslora": dict(r=16, lora_alpha=8, target_modules=MODULES, use_rslora=True, seed=2),
    "peft-patterns": dict(
        r=8,
        lora_alpha=16,
        target_modules=MODULES,
        seed=3,
        rank_pattern={"v_proj": 4, "model.layers.1.mlp.down_proj": 2},
        alpha_pattern={"o_proj": 4.0, "model.layers.0.self_attn.q_proj": 32.0},
    ),
    "peft-subset-layer1": dict(
        r=4, lora_alpha=4, target_modules=("k_proj", "up_proj"), layers_to_transform=[1], seed=4
    ),
    "peft-embed": dict(r=4, lora_alpha=8, target_modules=("q_proj", "embed_tokens"), seed=5),
}


@pytest.fixture(scope="session")
def base_config(tiny_model_dir: Path) -> dict:
    return json.loads((tiny_model_dir / "config.json").read_text())


@pytest.fixture(scope="session")
def peft_root(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Adapters made by the real peft library, one directory each (read-only for tests)."""
    root = tmp_path_factory.mktemp("peft-adapters")
    for name, kwargs in PEFT_ADAPTERS.items():
        make_peft_adapter(tiny_model_dir, root / name, **kwargs)
    return root


@pytest.fixture
def adapter_root(peft_root: Path, tmp_path: Path) -> Path:
    """A fresh adapter root per test with copies of the peft adapters (tests may add bad ones)."""
    root = tmp_path / "adapters"
    shutil.copytree(peft_root, root)
    return root


@pytest.fixture
def make_demo(adapter_root: Path, base_config: dict) -> Callable[..., Path]:
    """Write one adapter with our own generator under the adapter root; returns its directory."""
    from loraserve.adapter_store.demo import DemoAdapterSpec, write_peft_adapter

    def make(
        name: str,
        r: int = 4,
        lora_alpha: float = 8,
        target_modules: tuple[str, ...] = ("q_proj", "v_proj"),
        **kwargs,
    ) -> Path:
        return write_peft_adapter(
            adapter_root / name, base_config, DemoAdapterSpec(name, r, lora_alpha, target_modules, **kwargs)
        )

    return make


@pytest.fixture
def store_config(tiny_model_dir: Path, adapter_root: Path, tmp_path: Path) -> StoreConfig:
    from loraserve.adapter_store.config import StoreConfig

    return StoreConfig(
        base_model=str(tiny_model_dir),
        host="127.0.0.1",
        port=0,
        data_dir=str(tmp_path / "data"),
        adapter_root=str(adapter_root),
        grace_period_s=1.0,
    )


@pytest.fixture
def start_store(store_config: StoreConfig) -> Iterator[Callable[..., BackgroundStore]]:
    """start_store(**overrides) -> a running store; every store is stopped at teardown."""
    from loraserve.adapter_store.server import BackgroundStore

    started: list[BackgroundStore] = []

    def start(**overrides) -> BackgroundStore:
        store = BackgroundStore(store_config.replace(**overrides))
        started.append(store)
        return store

    yield start
    for store in started:
        store.stop()


@pytest.fixture
def store(start_store: Callable[..., BackgroundStore]) -> BackgroundStore:
    return start_store()


@pytest.fixture
def stub(store: BackgroundStore) -> Iterator[Any]:
    """An AdapterStoreStub on `store`."""
    import grpc

    from loraserve.v1 import store_pb2_grpc

    with grpc.insecure_channel(store.address) as channel:
        yield store_pb2_grpc.AdapterStoreStub(channel)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's standalone S3 server on a free port, with dummy credentials in the environment."""
    from moto.server import ThreadedMotoServer

    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # binds a free port
    server.start()
    yield "http://{}:{}".format(*server.get_host_and_port())
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def s3_bucket(s3_endpoint: str, peft_root: Path) -> str:
    """Bucket `adapters` holding every peft adapter under team-a/<name>/."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket="adapters")
    for d in peft_root.iterdir():
        for f in d.iterdir():
            s3.upload_file(str(f), "adapters", f"team-a/{d.name}/{f.name}")
    return "adapters"
