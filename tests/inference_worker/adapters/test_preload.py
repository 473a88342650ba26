"""--preload-adapters: a worker fetches the adapters named (or every adapter the store lists) and
fills free GPU slots before it serves, never evicting; what fails or does not fit is reported and
the worker serves anyway (real store and worker, tiny model, CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from loraserve.adapter_store.demo import DemoAdapterSpec
from loraserve.clients.worker_client import WorkerClient
from loraserve.inference_worker.adapters.preload import PreloadReport, parse_preload
from loraserve.inference_worker.config import WorkerConfig
from loraserve.inference_worker.server import BackgroundWorker
from loraserve.v1 import worker_pb2
from tests.helpers.lora_store import start_demo_store
from tests.helpers.workers import worker_config

IDS = tuple(f"pre-{i}" for i in range(5))


@pytest.fixture(scope="module")
def store(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    specs = tuple(
        DemoAdapterSpec(aid, r=2, lora_alpha=4, target_modules=("q_proj", "v_proj"), seed=i)
        for i, aid in enumerate(IDS)
    )
    s = start_demo_store(tiny_model_dir, specs, tmp_path_factory.mktemp("preload"))
    yield s
    s.stop()


@contextmanager
def _started(model_dir: Path, store, preload: str, **kw) -> Iterator[tuple[BackgroundWorker, PreloadReport]]:
    """A worker started with --preload-adapters `preload` (popularity prefetch at its default),
    and what its preload reported."""
    worker = BackgroundWorker(
        worker_config(model_dir, store_address=store.address, preload_adapters=preload, **kw)
    )
    try:
        assert worker.server is not None and worker.server.preloaded is not None
        yield worker, worker.server.preloaded
    finally:
        worker.stop()


def _held(worker: BackgroundWorker) -> dict[str, str]:
    with WorkerClient(worker.address) as client:
        return {a.adapter_id: worker_pb2.AdapterTier.Name(a.tier) for a in client.list_adapters()}


def test_named_adapters_are_in_slots_before_the_worker_serves(tiny_model_dir, store) -> None:
    with _started(tiny_model_dir, store, "pre-1, pre-3,pre-1", max_loras=4, max_cpu_loras=6) as (
        worker,
        report,
    ):
        assert report.gpu == ["pre-1", "pre-3"] and not report.failed  # in the order named
        held = _held(worker)  # as soon as it answers: loaded before it served
        assert held == {"pre-1": "ADAPTER_TIER_GPU", "pre-3": "ADAPTER_TIER_GPU"}


def test_every_listed_adapter_fills_free_room_and_the_rest_is_counted(tiny_model_dir, store) -> None:
    # 2 slots, 3 CPU entries, 5 adapters: two in slots, one more in the CPU tier, two skipped
    with _started(tiny_model_dir, store, "*", max_loras=2, max_cpu_loras=3) as (worker, report):
        assert len(report.gpu) == 2 and len(report.cpu) == 1 and len(report.skipped) == 2
        assert sorted(report.gpu + report.cpu + report.skipped) == list(IDS) and not report.failed
        held = _held(worker)
        assert sorted(held.values()) == ["ADAPTER_TIER_CPU", "ADAPTER_TIER_GPU", "ADAPTER_TIER_GPU"]
        assert set(held) == set(report.gpu + report.cpu)  # nothing preloaded was displaced


def test_a_pinned_version_is_preloaded_and_reported_as_named(tiny_model_dir, store) -> None:
    from loraserve.clients.store_client import StoreClient

    with StoreClient(store.address) as client:
        pinned = f"pre-2@{client.get('pre-2').digest}"
    with _started(tiny_model_dir, store, pinned, max_loras=2, max_cpu_loras=4) as (worker, report):
        assert report.gpu == [pinned] and not report.skipped and not report.failed
        assert _held(worker) == {"pre-2": "ADAPTER_TIER_GPU"}


def test_an_unknown_adapter_is_reported_and_the_worker_serves_the_rest(tiny_model_dir, store) -> None:
    with _started(tiny_model_dir, store, "pre-0,no-such-adapter", max_loras=2, max_cpu_loras=4) as (
        worker,
        report,
    ):
        assert report.gpu == ["pre-0"] and list(report.failed) == ["no-such-adapter"]
        with WorkerClient(worker.address) as client:  # serving: a generation with the preloaded one
            assert len(client.generate("hello", adapter_id="pre-0", max_tokens=3).token_ids) == 3


def test_when_the_time_runs_out_the_worker_serves_with_what_it_has(tiny_model_dir, store) -> None:
    with _started(tiny_model_dir, store, "*", max_loras=2, max_cpu_loras=6, preload_timeout_s=0.001) as (
        worker,
        report,
    ):
        assert report.timed_out and not report.gpu  # (not even the first fetch landed in time)
        with WorkerClient(worker.address) as client:
            assert len(client.generate("hi", adapter_id="pre-2", max_tokens=2).token_ids) == 2


def test_the_preload_list_is_checked_with_the_configuration() -> None:
    assert parse_preload(" * ") is None and parse_preload("a, b,a") == ["a", "b"]
    with pytest.raises(ValueError, match="adapter store"):
        WorkerConfig(model="m", preload_adapters="a")
    with pytest.raises(ValueError, match="preload_adapters"):
        WorkerConfig(model="m", store_address="h:1", preload_adapters="bad id!")
    with pytest.raises(ValueError, match="preload_timeout_s"):
        WorkerConfig(model="m", preload_timeout_s=0)


def test_the_worker_is_announced_to_the_fleet_only_once_it_serves(tiny_model_dir, store, monkeypatch) -> None:
    """Preload, then health SERVING, then the fleet sync (heartbeat, residency, prefetch): a router
    never sends requests to a worker that is still preloading or warming up."""
    from grpc_health.v1 import health, health_pb2

    import loraserve.inference_worker.server as server_module
    from loraserve.inference_worker.adapters.worker_adapters import WorkerAdapters

    events: list[str] = []
    real_preload, real_set, real_sync = (
        server_module.preload,
        health.aio.HealthServicer.set,
        WorkerAdapters.start_sync,
    )

    async def preload(*args, **kw):
        got = await real_preload(*args, **kw)
        events.append("preloaded")
        return got

    async def set_status(self, service, status):
        if status == health_pb2.HealthCheckResponse.SERVING and "serving" not in events:
            events.append("serving")
        return await real_set(self, service, status)

    def start_sync(self):
        events.append("announced")
        return real_sync(self)

    monkeypatch.setattr(server_module, "preload", preload)
    monkeypatch.setattr(health.aio.HealthServicer, "set", set_status)
    monkeypatch.setattr(WorkerAdapters, "start_sync", start_sync)
    with _started(tiny_model_dir, store, "pre-4", max_loras=2, max_cpu_loras=4) as (_, report):
        assert report.gpu == ["pre-4"]
        assert events == ["preloaded", "serving", "announced"]


def test_every_listed_adapter_goes_by_the_fleets_popularity(tiny_model_dir, store, monkeypatch) -> None:
    """`*` with room for three of five: the two the fleet asks for most take the slots, in that
    order, whichever fetch lands first; then the rest by id."""
    from loraserve.inference_worker.coordination.in_process import InProcessCoordinator

    monkeypatch.setattr(InProcessCoordinator, "fleet_popularity", lambda self: {"pre-3": 9.0, "pre-1": 4.0})
    with _started(tiny_model_dir, store, "*", max_loras=2, max_cpu_loras=3) as (_, report):
        assert report.gpu == ["pre-3", "pre-1"] and report.cpu == ["pre-0"]
        assert sorted(report.skipped) == ["pre-2", "pre-4"]
