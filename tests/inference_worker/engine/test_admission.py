"""Admission with scarce slots: a request whose adapter needs a slot that running sequences hold
waits, without blocking base requests or requests for resident adapters behind it."""

from __future__ import annotations

import time

from tests.helpers.local_worker import LocalWorker
from tests.helpers.peft_adapters import peft_reference

PROMPT = [5, 17, 42, 99, 7, 3]


def test_no_head_of_line_blocking_and_busy_slots_kept(tiny_model_dir, lora_adapter_root, lora_store):
    w = LocalWorker(tiny_model_dir, lora_store.address, max_loras=2, max_cpu_loras=3)
    try:
        w.call(w.adapters.load_adapter("mlp-rs16", "cpu"))  # in the CPU tier, no slot yet
        long_a = w.submit(PROMPT, "qv-r8", max_tokens=60)
        long_b = w.submit(PROMPT, "all-r4", max_tokens=60)
        deadline = time.monotonic() + 20
        while w.engine.num_running < 2:  # both slots now held by running sequences
            assert time.monotonic() < deadline
            time.sleep(0.005)
        cold = w.submit(PROMPT, "mlp-rs16", max_tokens=4)  # needs a slot: must wait
        base = w.submit(PROMPT, "", max_tokens=4)
        warm = w.submit(PROMPT, "qv-r8", max_tokens=4)  # resident: admitted past the waiting one
        for fut in (base, warm):
            fut.result(30)
        assert not cold.done() and not long_a.done() and not long_b.done()
        tokens, err, out = cold.result(60)
        assert (
            err is None
            and tokens == peft_reference(tiny_model_dir, lora_adapter_root / "mlp-rs16", PROMPT, 4)[0]
        )
        assert long_a.done() or long_b.done()  # it got a slot only once one was released
        for fut, name in ((long_a, "qv-r8"), (long_b, "all-r4")):
            got, err, _ = fut.result(60)
            assert (
                err is None and got == peft_reference(tiny_model_dir, lora_adapter_root / name, PROMPT, 60)[0]
            )
        assert w.engine.num_steps < 70  # it never blocked the steps of the others
    finally:
        w.close()
