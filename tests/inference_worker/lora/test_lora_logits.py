"""Logits of the LoRA-wrapped model against transformers + peft (fp32, tight tolerance): each
adapter alone and all of them, with base rows, prefilled together in one mixed batch."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine_logits import prefill_logits as engine_prefill_logits
from tests.helpers.local_worker import LocalWorker
from tests.helpers.lora_store import ADAPTER_SPECS
from tests.helpers.peft_adapters import peft_reference

PROMPTS = ([5, 17, 42, 99, 7, 3], [200, 31, 8, 150, 64, 12, 77, 9, 300, 4, 4])


@pytest.fixture(scope="module")
def local_worker(tiny_model_dir, lora_store):
    w = LocalWorker(tiny_model_dir, lora_store.address, max_loras=len(ADAPTER_SPECS), start_engine=False)
    for name in ADAPTER_SPECS:
        w.call(w.adapters.load_adapter(name, "gpu"))
    yield w
    w.close()


def prefill_logits(w: LocalWorker, rows: list[tuple[str, list[int]]]) -> torch.Tensor:
    return engine_prefill_logits(w.engine, rows)


def test_logits_match_peft(local_worker, tiny_model_dir, lora_adapter_root):
    rows, want = [], []
    for name in ["", *ADAPTER_SPECS]:
        for prompt in PROMPTS:
            ref = peft_reference(tiny_model_dir, lora_adapter_root / name if name else None, prompt, 1)[1]
            got = prefill_logits(local_worker, [(name, prompt)])[0]
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4, msg=f"adapter {name!r}")
            rows.append((name, prompt))
            want.append(ref)
    # one mixed batch: every adapter and base, rows interleaved
    order = list(range(len(rows)))[::-1]
    mixed = prefill_logits(local_worker, [rows[i] for i in order])
    for j, i in enumerate(order):
        torch.testing.assert_close(mixed[j], want[i], rtol=1e-4, atol=1e-4, msg=f"row {rows[i][0]!r}")
    base = want[0]
    assert all((w - base).abs().max() > 1e-2 for w in want[len(PROMPTS) :])  # adapters matter
