"""A thousand adapters in one store (Redis registry), paged listing, and a worker with 4 GPU slots
and an 8-entry CPU cache serving 48 of them at once: every answer is the adapter's own."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from loraserve.adapter_store.config import StoreConfig
from loraserve.adapter_store.demo import DemoAdapterSpec, write_demo_adapters
from loraserve.adapter_store.server import BackgroundStore
from loraserve.clients.store_client import AsyncStoreClient, StoreClient
from loraserve.clients.worker_client import WorkerClient
from loraserve.inference_worker.config import WorkerConfig
from loraserve.inference_worker.server import BackgroundWorker

pytestmark = [pytest.mark.slow, pytest.mark.redis]
NUM_ADAPTERS = 1000
NUM_SERVED = 48
PROMPT = [9, 99, 199, 299]


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory):
    import redis

    root = tmp_path_factory.mktemp("many")
    # 16 distinct checkpoints; the other ids reuse them by copy (distinct ids, distinct registrations)
    specs = tuple(
        DemoAdapterSpec(
            f"base-{i}", r=2 + i % 4, lora_alpha=8, target_modules=("q_proj", "v_proj"), seed=100 + i
        )
        for i in range(16)
    )
    write_demo_adapters(root, tiny_model_dir, specs)
    for n in range(NUM_ADAPTERS):
        src = root / f"base-{n % 16}"
        dst = root / f"a{n:04d}"
        dst.mkdir()
        for f in src.iterdir():
            shutil.copyfile(f, dst / f.name)
    prefix = f"loraserve-test-{uuid.uuid4().hex[:8]}:"
    store = BackgroundStore(
        StoreConfig(
            base_model=str(tiny_model_dir),
            port=0,
            adapter_root=str(root),
            data_dir=str(tmp_path_factory.mktemp("many-store")),
            serving_dtype="float32",
            redis_url=redis_url,
            redis_prefix=prefix,
            cache_max_adapters=64,
            max_pending_registrations=64,
            log_level="WARNING",
        )
    )
    worker = BackgroundWorker(
        WorkerConfig(
            model=str(tiny_model_dir),
            port=0,
            device="cpu",
            dtype="float32",
            store_address=store.address,
            max_loras=4,
            max_cpu_loras=8,
            max_num_seqs=16,
            num_kv_blocks=256,
            log_level="WARNING",
        )
    )
    yield store, worker
    worker.stop()
    store.stop()
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=prefix + "*"))
    if keys:
        r.delete(*keys)


def test_a_thousand_adapters(fleet) -> None:
    store, worker = fleet

    async def register_all() -> list:
        async with AsyncStoreClient(store.address) as c:
            sem = asyncio.Semaphore(32)

            async def one(n: int):
                async with sem:
                    return await c.register(f"a{n:04d}", f"a{n:04d}")

            return await asyncio.gather(*(one(n) for n in range(NUM_ADAPTERS)))

    infos = asyncio.run(register_all())
    digests = {i.adapter_id: i.digest for i in infos}
    assert len(digests) == NUM_ADAPTERS
    assert len(set(digests.values())) == 16  # same checkpoint, same optimized payload

    with StoreClient(store.address) as c:
        page = c.list_page(page_size=100)
        assert page.total_count == NUM_ADAPTERS and len(page.adapters) == 100
        listed = [a.adapter_id for a in c.list(page_size=100)]
    assert listed == sorted(digests)

    served = [f"a{n:04d}" for n in range(0, NUM_ADAPTERS, NUM_ADAPTERS // NUM_SERVED)][:NUM_SERVED]
    with WorkerClient(worker.address, timeout=120) as w:
        expected = {f"base-{i}": None for i in range(16)}
        for n in range(16):  # each distinct checkpoint once, alone
            expected[f"base-{n}"] = w.generate(PROMPT, adapter_id=f"a{n:04d}", max_tokens=5).token_ids

        def call(adapter_id: str):
            return w.generate(PROMPT, adapter_id=adapter_id, max_tokens=5)

        with ThreadPoolExecutor(16) as pool:
            outs = list(pool.map(call, served * 2))
        held = w.list_adapters()
    for adapter_id, out in zip(served * 2, outs, strict=True):
        assert out.adapter_digest == digests[adapter_id]
        assert out.token_ids == expected[f"base-{int(adapter_id[1:]) % 16}"], adapter_id
    assert len([a for a in held if a.slot >= 0]) <= 4 and len(held) <= 8
