"""A real worker (gRPC on a free port) serving PEFT adapters from a real store: parity with
transformers + peft alone and in one batch, more adapters than slots under concurrent load, the
store going away and coming back, re-registration."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest

from loraserve.v1 import worker_pb2
from tests.helpers.lora_store import ADAPTER_SPECS, start_lora_store
from tests.helpers.peft_adapters import peft_reference
from tests.helpers.ports import free_port

PROMPTS = ([5, 17, 42, 99, 7, 3], [200, 31, 8, 150, 64, 12, 77, 9, 300])
MAX_TOKENS = 8
NAMES = ["", *ADAPTER_SPECS]


@pytest.fixture(scope="module")
def references(tiny_model_dir, lora_adapter_root):
    """(adapter dir name or "", prompt index) -> PEFT greedy tokens."""
    refs = {}
    for name in [*NAMES, "alt-qv-r8"]:
        for i, prompt in enumerate(PROMPTS):
            refs[(name, i)] = peft_reference(
                tiny_model_dir, lora_adapter_root / name if name else None, prompt, MAX_TOKENS
            )[0]
    return refs


# a worker with LoRA slots and room for the concurrent-load tests
LORA_WORKER = dict(
    max_num_seqs=16,
    max_num_batched_tokens=256,
    num_kv_blocks=256,
    max_queue_size=256,
    max_loras=6,
    max_cpu_loras=8,
    max_lora_rank=64,
    adapter_poll_interval_s=0.1,  # learn of store changes quickly
)


@pytest.fixture
def start_lora_worker(start_worker):
    """start_lora_worker(store address, **config overrides) -> BackgroundWorker."""

    def start(store_address: str, **overrides):
        bg = start_worker(**{**LORA_WORKER, "store_address": store_address, **overrides})
        return bg

    return start


def client(address: str):
    from loraserve.clients.worker_client import WorkerClient

    return WorkerClient(address, timeout=60)


def generate(address: str, prompt: list[int], adapter_id: str):
    with client(address) as w:
        return w.generate(prompt, adapter_id=adapter_id, max_tokens=MAX_TOKENS)


def test_parity_with_peft_alone_and_in_one_batch(lora_store, references, start_lora_worker):
    bg = start_lora_worker(lora_store.address)
    digests = {name: lora_store.stub().GetAdapter(_get(name), timeout=10).digest for name in ADAPTER_SPECS}
    for name in NAMES:
        for i, prompt in enumerate(PROMPTS):
            out = generate(bg.address, prompt, name)
            assert out.token_ids == references[(name, i)], (name, i)
            assert out.adapter_digest == digests.get(name, "")
            # where the adapter was when the request came: fetched for the first, in a slot after
            assert out.usage.adapter_tier == ("" if not name else "store" if i == 0 else "gpu")
    # all adapters and base at once, both prompts: one batch of 12 rows
    steps = bg.engine.num_steps
    jobs = [(name, i) for name in NAMES for i in range(len(PROMPTS))]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: generate(bg.address, PROMPTS[j[1]], j[0]), jobs))
    for job, out in zip(jobs, outs, strict=True):
        assert out.token_ids == references[job], job
    assert bg.engine.num_steps - steps < len(jobs) * MAX_TOKENS / 2  # they shared steps


def _get(adapter_id: str):
    from loraserve.v1 import store_pb2

    return store_pb2.GetAdapterRequest(adapter_id=adapter_id)


def test_more_adapters_than_slots_under_load(lora_store, references, start_lora_worker, lora_adapter_root):
    lora_store.register("alt", "alt-qv-r8", overwrite=True)
    bg = start_lora_worker(lora_store.address, max_loras=2, max_cpu_loras=3, max_num_seqs=8)
    with client(bg.address) as w:
        assert w.pin_adapter("qv-r8", True).pinned
        with pytest.raises(grpc.RpcError) as e:
            w.pin_adapter("all-r4", True)  # at most max_loras - 1 = 1 pin
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    adapters = {**{n: n for n in ADAPTER_SPECS}, "alt": "alt-qv-r8"}  # worker id -> reference
    jobs = [(aid, i) for _ in range(2) for aid in [*adapters, ""] for i in range(len(PROMPTS))]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda j: generate(bg.address, PROMPTS[j[1]], j[0]), jobs))
    for (aid, i), out in zip(jobs, outs, strict=True):
        assert out.token_ids == references[(adapters.get(aid, ""), i)], (aid, i)
    with client(bg.address) as w:
        listed = {a.adapter_id: a for a in w.list_adapters()}
    from loraserve.v1 import worker_pb2

    pinned = listed["qv-r8"]
    assert pinned.pinned and pinned.tier == worker_pb2.ADAPTER_TIER_GPU and pinned.num_gpu_loads == 1
    # every adapter still listed served its 2 rounds x len(PROMPTS) requests (preemptions not recounted)
    served = {a.adapter_id: a.num_requests for a in listed.values() if a.adapter_id in adapters}
    assert served and served == dict.fromkeys(served, 2 * len(PROMPTS))
    metrics = bg.server.adapters.pool.metrics
    assert metrics.value("loraserve_worker_adapter_evictions_total", {"tier": "gpu"}) > 0
    assert metrics.value("loraserve_worker_adapter_evictions_total", {"tier": "cpu"}) > 0
    assert metrics.value("loraserve_worker_adapter_slots_used") <= 2
    assert all(a.num_running == 0 for a in listed.values())
    # the worker's Prometheus registry carries the adapter metrics
    assert bg.server.metrics.registry.get_sample_value("loraserve_worker_adapter_slots") == 2


def test_store_down_cached_adapters_keep_serving(
    tiny_model_dir, lora_adapter_root, references, start_lora_worker, tmp_path
):
    port = free_port()
    st = start_lora_store(tiny_model_dir, lora_adapter_root, tmp_path / "store", port=port)
    for name in ("qv-r8", "all-r4", "mlp-rs16"):
        st.register(name, name)
    bg = start_lora_worker(st.address, max_loras=2, max_cpu_loras=3)
    with client(bg.address) as w:
        assert w.load_adapter("qv-r8", "gpu").slot >= 0
        assert w.load_adapter("all-r4", "cpu").slot == -1
        with pytest.raises(grpc.RpcError) as bad_tier:
            w.stub.LoadAdapter(worker_pb2.LoadAdapterRequest(adapter_id="qv-r8", tier=7), timeout=10)
        assert (
            bad_tier.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tier" in bad_tier.value.details()
        )
    st.store.stop()
    try:
        assert generate(bg.address, PROMPTS[0], "qv-r8").token_ids == references[("qv-r8", 0)]
        assert generate(bg.address, PROMPTS[0], "all-r4").token_ids == references[("all-r4", 0)]
        assert generate(bg.address, PROMPTS[0], "").token_ids == references[("", 0)]
        with pytest.raises(grpc.RpcError) as e:
            generate(bg.address, PROMPTS[0], "mlp-rs16")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        st = start_lora_store(
            tiny_model_dir, lora_adapter_root, tmp_path / "store", port=port
        )  # same registry
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                out = generate(bg.address, PROMPTS[1], "mlp-rs16")
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert out.token_ids == references[("mlp-rs16", 1)]
    finally:
        st.store.stop()


def test_reregistered_adapter_is_never_served_stale(lora_store, references, start_lora_worker):
    old = lora_store.register("swap", "qv-r8", overwrite=True)
    bg = start_lora_worker(lora_store.address)
    out = generate(bg.address, PROMPTS[0], "swap")
    assert (out.adapter_digest, out.token_ids) == (old.digest, references[("qv-r8", 0)])
    new = lora_store.register("swap", "alt-qv-r8", overwrite=True)
    deadline = time.monotonic() + 10
    while True:  # until the worker learns of it, the old version may still answer — correctly
        out = generate(bg.address, PROMPTS[0], "swap")
        if out.adapter_digest == new.digest:
            break
        assert out.token_ids == references[("qv-r8", 0)]
        assert time.monotonic() < deadline, "the worker never learned of the new digest"
        time.sleep(0.05)
    for i in (0, 1, 0):  # from then on only the new version
        out = generate(bg.address, PROMPTS[i], "swap")
        assert (out.adapter_digest, out.token_ids) == (new.digest, references[("alt-qv-r8", i)])
    assert generate(bg.address, PROMPTS[1], f"swap@{new.digest}").token_ids == references[("alt-qv-r8", 1)]
    with pytest.raises(grpc.RpcError) as e:
        generate(bg.address, PROMPTS[0], f"swap@{old.digest}")
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with client(bg.address) as w:  # the refused stale pin's fetch may still be ending: never held
        deadline = time.monotonic() + 5
        while (held := {a.digest for a in w.list_adapters() if a.adapter_id == "swap"}) != {new.digest}:
            assert time.monotonic() < deadline, held
            time.sleep(0.05)
    lora_store.delete("swap")
    deadline = time.monotonic() + 10
    while True:
        try:
            generate(bg.address, PROMPTS[0], "swap")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND
            break
        assert time.monotonic() < deadline, "a deleted adapter kept being served"
        time.sleep(0.05)


@pytest.mark.redis
def test_invalidation_through_redis(
    redis_url, redis_prefix, tiny_model_dir, lora_adapter_root, references, start_lora_worker, tmp_path
):
    """Store and worker share Redis: the registry's replace event reaches the worker through the
    coordinator's stream (the worker's own polling of the store is off here)."""
    prefix = redis_prefix
    st = start_lora_store(
        tiny_model_dir, lora_adapter_root, tmp_path / "store", redis_url=redis_url, redis_prefix=prefix
    )
    try:
        old = st.register("swap", "qv-r8")
        bg = start_lora_worker(st.address, redis_url=redis_url, redis_prefix=prefix)
        bg.call(bg.server.adapters.store_check.stop())
        assert generate(bg.address, PROMPTS[0], "swap").adapter_digest == old.digest
        new = st.register("swap", "alt-qv-r8", overwrite=True)
        deadline = time.monotonic() + 10
        while (out := generate(bg.address, PROMPTS[0], "swap")).adapter_digest != new.digest:
            assert time.monotonic() < deadline, "the Redis event never reached the worker"
            time.sleep(0.05)
        assert out.token_ids == references[("alt-qv-r8", 0)]
        adapters = bg.server.adapters
        deadline = time.monotonic() + 10
        while {
            (r.adapter_id, r.digest) for r in adapters.coordinator.residencies(adapters.pool.worker_id)
        } != {("swap", new.digest)}:
            assert time.monotonic() < deadline, "residency never reached Redis"
            time.sleep(0.05)
    finally:
        st.store.stop()
