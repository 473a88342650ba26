"""What the gateway tests share besides their fixtures (tests/gateway/conftest.py): the adapters
the store holds, the API key, a worker fetching from the store, and the official `openai` client."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.helpers.lora_store import StoreHandle
from tests.helpers.workers import worker_config

if TYPE_CHECKING:
    import openai

    from loraserve.inference_worker.server import BackgroundWorker

ADAPTERS = ("peft-qv-r8", "peft-all-r16-rslora", "peft-patterns")
API_KEY = "sk-test-key"


def start_worker(tiny_model_dir: Path, store: StoreHandle, **overrides: Any) -> BackgroundWorker:
    from loraserve.inference_worker.server import BackgroundWorker

    base = dict(
        store_address=store.address,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        num_kv_blocks=256,
        max_loras=4,
        max_cpu_loras=8,
    )
    return BackgroundWorker(worker_config(tiny_model_dir, **{**base, **overrides}))


def openai_client(url: str, api_key: str = API_KEY, **kw: Any) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)
