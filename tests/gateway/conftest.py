"""Fixtures of the gateway tests: a real store holding peft adapters, a real worker on the tiny model
fetching from it, and the gateway in front of them on 127.0.0.1 port 0, talked to with the official
`openai` client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.gateway import ADAPTERS, API_KEY, openai_client, start_worker
from tests.helpers.lora_store import StoreHandle, start_lora_store


@pytest.fixture(scope="package")
def gateway_store(tiny_model_dir: Path, peft_root: Path, tmp_path_factory: pytest.TempPathFactory):
    handle = start_lora_store(tiny_model_dir, peft_root, tmp_path_factory.mktemp("gateway-store"))
    for name in ADAPTERS:
        handle.register(name, name)
    yield handle
    handle.store.stop()  # type: ignore[attr-defined]


@pytest.fixture(scope="package")
def gateway_worker(tiny_model_dir: Path, gateway_store: StoreHandle):
    bg = start_worker(tiny_model_dir, gateway_store)
    yield bg
    bg.stop()


@pytest.fixture
def start_gateway() -> Iterator[Callable]:
    """start_gateway(**GatewayConfig fields) -> a running BackgroundGateway; stopped at teardown."""
    from loraserve.gateway.config import GatewayConfig
    from loraserve.gateway.server import BackgroundGateway

    started: list[BackgroundGateway] = []

    def start(**fields) -> BackgroundGateway:
        gw = BackgroundGateway(
            GatewayConfig(**{"host": "127.0.0.1", "port": 0, "log_level": "WARNING", **fields})
        )
        started.append(gw)
        return gw

    yield start
    for gw in started:
        gw.stop()


@pytest.fixture(scope="package")
def gateway(gateway_worker, gateway_store: StoreHandle):
    """The shared gateway (API key required) in front of the shared worker."""
    from loraserve.gateway.config import GatewayConfig
    from loraserve.gateway.server import BackgroundGateway

    gw = BackgroundGateway(
        GatewayConfig(
            host="127.0.0.1",
            port=0,
            worker=gateway_worker.address,
            store=gateway_store.address,
            api_key=API_KEY,
            log_level="WARNING",
        )
    )
    yield gw
    gw.stop()


@pytest.fixture
def client(gateway):
    with openai_client(gateway.url) as c:
        yield c
