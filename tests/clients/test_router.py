"""WorkerRouter against a real store and two real workers (gRPC on free ports)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from loraserve.adapter_store.demo import DemoAdapterSpec
from loraserve.adapter_store.server import BackgroundStore
from loraserve.clients.placement import weight as _weight
from loraserve.clients.router import WorkerRouter
from loraserve.clients.worker_client import WorkerClient
from loraserve.inference_worker.server import BackgroundWorker
from tests.helpers.lora_store import start_demo_store
from tests.helpers.workers import worker_config

SPECS = tuple(
    DemoAdapterSpec(f"route-{i}", r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), seed=i)
    for i in range(8)
)
PROMPT = [5, 17, 42, 99, 7]


def _worker(model_dir: Path, store: BackgroundStore) -> BackgroundWorker:
    """A worker of the fleet: 2 GPU slots, 4 CPU entries."""
    return BackgroundWorker(
        worker_config(
            model_dir, max_num_batched_tokens=512, store_address=store.address, max_loras=2, max_cpu_loras=4
        )
    )


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    store = start_demo_store(tiny_model_dir, SPECS, tmp_path_factory.mktemp("route"))
    workers = [_worker(tiny_model_dir, store) for _ in range(2)]
    yield store, workers
    for w in workers:
        w.stop()
    store.stop()


def _alone(address: str, adapter_id: str) -> list[int]:
    with WorkerClient(address, timeout=60) as w:
        return w.generate(PROMPT, adapter_id=adapter_id, max_tokens=6).token_ids


def test_adapter_sticks_to_its_home_worker(fleet) -> None:
    _, workers = fleet
    addresses = [w.address for w in workers]
    with WorkerRouter(addresses, refresh_s=0.0, timeout=60) as router:
        home = max(addresses, key=lambda a: _weight("route-0", a))
        assert router.pick("route-0") == home
        out = router.generate(PROMPT, adapter_id="route-0", max_tokens=6)
        assert out.adapter_id == "route-0"
        # the home worker now reports the adapter in a GPU slot; the other holds nothing
        held = {w.address: {a.adapter_id for a in WorkerClient(w.address).list_adapters()} for w in workers}
        assert "route-0" in held[home]
        assert all("route-0" not in ids for addr, ids in held.items() if addr != home)
        assert router.pick("route-0@" + out.adapter_digest) == home
        assert out.token_ids == _alone(home, "route-0")


def test_residency_beats_hashing(fleet) -> None:
    _, workers = fleet
    addresses = [w.address for w in workers]
    other = min(addresses, key=lambda a: _weight("route-1", a))  # not route-1's hash home
    with WorkerClient(other, timeout=60) as w:
        w.load_adapter("route-1", tier="gpu")
    with WorkerRouter(addresses, refresh_s=0.0, timeout=60) as router:
        assert router.pick("route-1") == other


def test_adapters_held_nowhere_go_home_whatever_the_free_slots(fleet) -> None:
    _, workers = fleet
    addresses = [w.address for w in workers]
    clients = [WorkerClient(a, timeout=60) for a in addresses]
    try:
        for c in clients:
            for a in c.list_adapters():
                c.unload_adapter(a.adapter_id)
        fresh = SPECS[4].name
        # its hash home: the highest weight (which worker that is depends on the ports)
        home, away = sorted(range(2), key=lambda i: _weight(fresh, addresses[i]), reverse=True)
        with WorkerRouter(addresses, refresh_s=0.0) as router:
            assert router.pick(fresh) == addresses[home]
            for name in ("route-2", "route-3"):  # the home's two GPU slots fill up, the other's are free
                clients[home].load_adapter(name, tier="gpu")
            assert router.pick(fresh) == addresses[home]  # still its home: the worker that prefetches it
    finally:
        for c in clients:
            c.close()


def test_ids_spread_over_workers(fleet) -> None:
    _, workers = fleet
    with WorkerRouter([w.address for w in workers], refresh_s=60.0) as router:
        homes = {router.pick(f"unknown-{i}") for i in range(32)}
    assert homes == {w.address for w in workers}


def test_fails_over_when_a_worker_is_gone(fleet, tiny_model_dir: Path) -> None:
    store, workers = fleet
    live = workers[0].address
    for _ in range(3):  # the extra worker's port decides the homes: 1 in 256 homes none of the 8 adapters
        extra = _worker(tiny_model_dir, store)
        adapter = max((s.name for s in SPECS), key=lambda n: _weight(n, extra.address) - _weight(n, live))
        if _weight(adapter, extra.address) > _weight(adapter, live):
            break
        extra.stop()
    assert _weight(adapter, extra.address) > _weight(adapter, live)  # its home is the worker that goes away
    addresses = [extra.address, live]
    with WorkerRouter(addresses, refresh_s=60.0, down_s=60.0, timeout=60) as router:
        expected = _alone(live, adapter)
        extra.stop()
        out = router.generate(PROMPT, adapter_id=adapter, max_tokens=6)
        assert out.token_ids == expected
        assert router.pick(adapter) == live
        deltas = list(router.generate_stream(PROMPT, adapter_id=adapter, max_tokens=6))
        assert [t for d in deltas for t in d.token_ids] == expected


def test_non_retryable_errors_surface(fleet) -> None:
    _, workers = fleet
    with WorkerRouter([w.address for w in workers], refresh_s=0.0, timeout=60) as router:
        with pytest.raises(grpc.RpcError) as err:
            router.generate(PROMPT, adapter_id="no-such-adapter", max_tokens=4)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_needs_an_address() -> None:
    with pytest.raises(ValueError):
        WorkerRouter([])


def test_slots_cli(fleet, capsys) -> None:
    from loraserve.clients.worker_cli import slots_main

    _, workers = fleet
    addr = ["--worker", workers[1].address]
    assert slots_main(["load", "route-5", "--tier", "cpu", *addr]) == 0
    assert "route-5" in capsys.readouterr().out
    assert slots_main(["pin", "route-5", *addr]) == 0  # pinning loads it into a GPU slot
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("route-5"))
    assert row.split()[1:4] == ["gpu", row.split()[2], "yes"] and row.split()[2].isdigit()
    assert slots_main(["list", *addr]) == 0
    listed = capsys.readouterr().out
    assert "route-5" in listed and "adapter(s)" in listed
    assert slots_main(["unpin", "route-5", *addr]) == 0 and slots_main(["unload", "route-5", *addr]) == 0
    assert "route-5: unloaded" in capsys.readouterr().out
    assert slots_main(["load", "no-such-adapter", *addr]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        slots_main(["pin", *addr])
