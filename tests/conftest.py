"""Fixtures shared by every test package: the tiny base model, a Redis URL, and the store fixtures
(tests/helpers/store_fixtures.py) that the store, client and contract tests use."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loraserve.inference_worker.model.tiny import TinyLlamaSpec, write_tiny_llama

pytest_plugins = ["tests.helpers.store_fixtures", "tests.helpers.tracing"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint in HF layout (2 layers, hidden 64, GQA 4/2 heads)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), TinyLlamaSpec())


@pytest.fixture(scope="session")
def redis_url() -> str:
    """A real Redis server; tests use DB 15 and their own key prefix, and clean up."""
    url = os.environ.get("LORASERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    try:
        import redis

        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    except Exception as exc:
        pytest.skip(f"no Redis server at {url}: {exc}")
    return url


@pytest.fixture
def redis_prefix(redis_url: str):
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    import uuid

    import redis

    prefix = f"loraserve-test-{uuid.uuid4().hex[:8]}:"
    yield prefix
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=prefix + "*"))
    if keys:
        r.delete(*keys)
    r.close()


@pytest.fixture(scope="session")
def smollm2_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real SmolLM2-135M-Instruct in HF layout, fetched once and cached (tests/helpers/real_model.py)."""
    from tests.helpers.real_model import smollm2_dir

    return smollm2_dir(request.config, tmp_path_factory)
