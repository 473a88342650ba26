"""Greedy generations of a worker built with a given tensor-parallel size, for the TP tests and the
TP benchmark's smoke mode: random adapters (made through the store's optimize step) loaded into
GPU slots through the worker's own admin path, every request submitted at once (one mixed batch)
and the engine stepped on the calling thread. A TP > 1 run happens in a process of its own (it
becomes rank 0 and starts its followers), so the test process keeps no process group."""

from __future__ import annotations

import json
import multiprocessing
from dataclasses import dataclass
from pathlib import Path

# random adapters: id -> (target modules and ranks, seed)
ADAPTERS: dict[str, tuple[dict[str, int], int]] = {
    "attn": ({"q_proj": 4, "k_proj": 4, "v_proj": 8, "o_proj": 4}, 1),
    "mlp": ({"gate_proj": 8, "up_proj": 4, "down_proj": 8}, 2),
    "all": ({m: 4 for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}, 3),
}
PROMPT = [5, 17, 42, 99, 7, 3, 11]


@dataclass(frozen=True)
class Request:
    adapter_id: str  # "" = base model
    prompt: tuple[int, ...]
    max_tokens: int = 6
    n: int = 1  # completions; n > 1 copies KV blocks to the siblings on every rank


def default_requests() -> list[Request]:
    """The base model and every adapter on one prompt, plus a longer prompt with two completions
    of an adapter, in one batch."""
    longer = tuple(PROMPT * 3)
    return [
        Request("", tuple(PROMPT)),
        *(Request(a, tuple(PROMPT)) for a in ADAPTERS),
        Request("all", longer, n=2),
    ]


def generate(model_dir: Path, tp_size: int, requests: list[Request]) -> list[list[int]]:
    """Token ids of each request (its completions' tokens in the order they came), greedy, fp32 on
    CPU, with tensor_parallel_size `tp_size`."""
    from loraserve.inference_worker.builder import build_worker
    from loraserve.inference_worker.engine.sequence import SamplingParams
    from tests.helpers.adapter_sources import AdaptersRunning, PayloadSource
    from tests.helpers.lora_payloads import payload_of, random_adapter
    from tests.helpers.workers import worker_config

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    layers = tuple(range(int(hf["num_hidden_layers"])))
    payloads = [
        payload_of(random_adapter(hf, targets, seed, layers), hf, name)
        for name, (targets, seed) in ADAPTERS.items()
    ]
    config = worker_config(
        model_dir,
        max_num_batched_tokens=64,
        max_model_len=128,
        num_kv_blocks=64,
        cuda_graphs=False,
        max_loras=len(ADAPTERS),
        max_cpu_loras=len(ADAPTERS),
        max_lora_rank=8,
        adapter_lookahead=0,
        adapter_prefetch=0,
        adapter_poll_interval_s=60.0,
        tensor_parallel_size=tp_size,
    )
    worker = build_worker(config, source=PayloadSource(payloads))
    engine, adapters = worker.engine, worker.adapters
    assert adapters is not None
    running = AdaptersRunning(adapters)
    try:
        running.load(ADAPTERS)
        tokens: list[list[int]] = [[] for _ in requests]
        done = [False] * len(requests)
        for i, r in enumerate(requests):

            def on_output(out, i=i) -> None:
                tokens[i].extend(out.token_ids)
                done[i] = done[i] or out.finished

            params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, n=r.n)
            engine.submit(engine.make_sequence(f"r{i}", "", list(r.prompt), params, on_output, r.adapter_id))
        while not all(done):
            engine.step()
        return tokens
    finally:
        engine.shutdown()
        running.close()


def _child(model_dir: Path, tp_size: int, requests: list[Request], out: multiprocessing.Queue) -> None:
    try:
        out.put(("ok", generate(model_dir, tp_size, requests)))
    except BaseException as exc:  # the test shows it
        out.put(("error", repr(exc)))


def generate_in_process(
    model_dir: Path, tp_size: int, requests: list[Request], timeout_s: float = 120
) -> list[list[int]]:
    """`generate` in a fresh process (spawned), which becomes rank 0 of the TP worker."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(model_dir, tp_size, requests, out), daemon=False)
    proc.start()
    try:
        status, value = out.get(timeout=timeout_s)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        raise AssertionError(f"the tensor-parallel run failed: {value}")
    return value
