"""The server around the service: bearer-token auth, TLS, health, reflection, paging, metrics,
graceful drain (in-process and on SIGTERM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from loraserve.clients.store_client import StoreClient
from loraserve.v1 import store_pb2, store_pb2_grpc
from tests.helpers.ports import free_port
from tests.helpers.store_calls import expect_error, register
from tests.helpers.tls import self_signed_cert

C = grpc.StatusCode


def test_admin_token(start_store) -> None:
    store = start_store(admin_token="s3cret")
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        req = store_pb2.RegisterAdapterRequest(adapter_id="a", source="peft-qv-r8")
        expect_error(lambda: stub.RegisterAdapter(req), C.UNAUTHENTICATED, "RegisterAdapter", "Bearer")
        expect_error(
            lambda: stub.RegisterAdapter(req, metadata=[("authorization", "Bearer nope")]),
            C.PERMISSION_DENIED,
            "not valid",
        )
        expect_error(
            lambda: stub.RegisterAdapter(req, metadata=[("authorization", "Basic s3cret")]),
            C.PERMISSION_DENIED,
        )
        assert stub.RegisterAdapter(req, metadata=[("authorization", "Bearer s3cret")]).rank == 8
        delete = store_pb2.DeleteAdapterRequest(adapter_id="a")
        expect_error(lambda: stub.DeleteAdapter(delete), C.UNAUTHENTICATED)
        # reads need no token
        assert stub.GetAdapter(store_pb2.GetAdapterRequest(adapter_id="a")).adapter_id == "a"
    with StoreClient(store.address, token="s3cret") as client:
        assert client.fetch("a").rank == 8
        assert client.delete("a").adapter_id == "a"


def test_tls(start_store, tmp_path: Path) -> None:
    cert, key = self_signed_cert(tmp_path)
    store = start_store(tls_cert=str(cert), tls_key=str(key))
    with StoreClient(f"localhost:{store.port}", root_certificates=cert) as client:
        assert client.register("a", "peft-qv-r8").rank == 8
        assert client.fetch("a").digest == client.get("a").digest
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        expect_error(
            lambda: stub.GetAdapter(store_pb2.GetAdapterRequest(adapter_id="a"), timeout=5), C.UNAVAILABLE
        )


def test_health_and_reflection(store) -> None:
    with grpc.insecure_channel(store.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "loraserve.v1.AdapterStore"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        answer = next(
            iter(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        )
        names = {s.name for s in answer.list_services_response.service}
        assert {"loraserve.v1.AdapterStore", "grpc.health.v1.Health"} <= names


def test_paged_listing(store) -> None:
    with StoreClient(store.address) as client:
        ids = [f"id-{i:02d}" for i in (5, 1, 4, 2, 3)]
        for i in ids:
            client.register(i, "peft-qv-r8")
        first = client.list_page(page_size=2)
        assert [a.adapter_id for a in first.adapters] == ["id-01", "id-02"] and first.total_count == 5
        second = client.list_page(page_size=2, page_token=first.next_page_token)
        third = client.list_page(page_size=2, page_token=second.next_page_token)
        assert [a.adapter_id for a in [*second.adapters, *third.adapters]] == ["id-03", "id-04", "id-05"]
        assert third.next_page_token == ""
        assert [a.adapter_id for a in client.list(page_size=2)] == sorted(ids)
        assert len(list(client.list())) == 5


def test_metrics_endpoint(start_store) -> None:
    port = free_port()
    store = start_store(metrics_port=port)
    with StoreClient(store.address) as client:
        client.register("a", "peft-qv-r8")
        client.fetch("a")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'loraserve_store_registrations_total{outcome="ok"} 1.0' in text
    assert "loraserve_store_fetch_bytes_total 10240.0" in text
    assert "loraserve_store_cache_hits_total 1.0" in text


def test_drain_refuses_new_work_and_finishes_running_streams(start_store) -> None:
    store = start_store(chunk_bytes=1024)
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        info = register(stub, "a", "peft-all-r16-rslora")
        stream = stub.FetchAdapter(store_pb2.FetchAdapterRequest(adapter_id="a"))
        assert next(stream).WhichOneof("payload") == "manifest"
        store.call(store.store.begin_drain())
        health = health_pb2_grpc.HealthStub(ch)
        assert (
            health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        )
        expect_error(lambda: register(stub, "b", "peft-qv-r8"), C.UNAVAILABLE, "draining")
        expect_error(
            lambda: list(stub.FetchAdapter(store_pb2.FetchAdapterRequest(adapter_id="a"))),
            C.UNAVAILABLE,
            "draining",
        )
        stopper = threading.Thread(target=store.stop, kwargs={"grace": 10.0, "drain": True})
        stopper.start()
        received = sum(len(m.chunk.data) for m in stream)
        assert received == info.size_bytes
        stopper.join(15)
        assert not stopper.is_alive()


@pytest.mark.slow
def test_sigterm_drains_the_process(tiny_model_dir: Path, adapter_root: Path, tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "LORASERVE_BASE_MODEL": str(tiny_model_dir),
        "LORASERVE_ADAPTER_ROOT": str(adapter_root),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "loraserve.cli",
            "store",
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "data"),
            "--grace-period-s",
            "2",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while True:
            try:
                with StoreClient(f"127.0.0.1:{port}", timeout=2) as client:
                    assert client.register("a", "peft-qv-r8").rank == 8
                break
            except grpc.RpcError:
                assert time.time() < deadline and proc.poll() is None
                time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "draining" in out
    finally:
        if proc.poll() is None:
            proc.kill()
