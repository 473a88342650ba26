"""The committed demo adapter on the real SmolLM2-135M-Instruct, served as `loraserve up` serves it
(a store registers it, a worker fetches it over gRPC): greedy chat answers equal transformers +
peft's (fp32, CPU) token for token, the base rows in the same batches equal transformers', and the
adapter's style is there to see."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from loraserve.adapter_store import demo
from loraserve.clients.worker_client import WorkerClient
from loraserve.up import SMOLLM2_ADAPTERS, EmbeddedDefault, register_demo_adapters, start_store, start_worker

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow

ADAPTER = SMOLLM2_ADAPTERS[0]
ADAPTER_DIR = Path(demo.__file__).parent / "demo_adapters" / ADAPTER
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Give me one tip for staying healthy."}],
    [
        {"role": "system", "content": "You are a friendly assistant."},
        {"role": "user", "content": "Hello! What do cats like to eat?"},
    ],
]
MAX_NEW = 20


@pytest.fixture(scope="module")
def served(smollm2_dir: Path, tmp_path_factory):
    """(worker address) of a store + worker on SmolLM2 with the demo adapter registered."""
    default = EmbeddedDefault(
        tmp_path_factory.mktemp("smollm2-up"),
        smollm2_dir,
        ADAPTER_DIR.parent,
        {ADAPTER: ADAPTER_DIR},
        chat=True,
    )
    store = start_store(default, port=0, serving_dtype="float32")
    worker = None
    try:
        register_demo_adapters(store.address, default)
        worker = start_worker(
            default,
            store.address,
            port=0,
            device="cpu",
            dtype="float32",
            max_model_len=512,
            num_kv_blocks=128,
            cuda_graphs=False,
        )
        yield worker.address
    finally:
        if worker is not None:
            worker.stop(grace=1.0)
        store.stop(grace=1.0)


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path):
    """(tokenizer, greedy(conv, with_adapter) -> generated token ids) of transformers + peft."""
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, str(ADAPTER_DIR)).eval()

    def greedy(conv, with_adapter: bool) -> list[int]:
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
        x = torch.tensor([list(ids)])
        with torch.inference_mode():
            if with_adapter:
                out = model.generate(input_ids=x, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=2)
            else:
                with model.disable_adapter():
                    out = model.generate(input_ids=x, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=2)
        gen = out[0, len(ids) :].tolist()
        end = tok.convert_tokens_to_ids("<|im_end|>")
        return gen[: gen.index(end)] if end in gen else gen  # we report the end of turn as the finish

    return tok, greedy


def test_adapter_and_base_answers_equal_peft(served: str, reference) -> None:
    tok, greedy = reference
    jobs = [(conv, adapter) for conv in CONVERSATIONS for adapter in (ADAPTER, "")]
    with WorkerClient(served, timeout=300) as w, ThreadPoolExecutor(len(jobs)) as pool:
        # all at once: adapter rows and base rows share the worker's batches
        futures = [
            pool.submit(w.generate, messages=conv, adapter_id=adapter, max_tokens=MAX_NEW)
            for conv, adapter in jobs
        ]
        results = [f.result() for f in futures]
    for (conv, adapter), got in zip(jobs, results, strict=True):
        want = greedy(conv, with_adapter=bool(adapter))
        assert got.token_ids == want, (adapter or "(base)", conv, tok.decode(got.token_ids), tok.decode(want))
        if adapter:
            assert got.text.startswith("Arr, matey!"), got.text  # the style shows at once
        else:
            assert "Arr" not in got.text, got.text
