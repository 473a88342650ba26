"""The store's read token: with one configured, FetchAdapter, GetAdapter and ListAdapters need it
(or the admin token), with the admin RPCs' UNAUTHENTICATED / PERMISSION_DENIED behaviour; a worker
presents it as its --store-token."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from loraserve.clients.store_client import StoreClient
from loraserve.clients.worker_client import WorkerClient
from loraserve.v1 import store_pb2, store_pb2_grpc
from tests.helpers.store_calls import expect_error
from tests.helpers.workers import worker_config

C = grpc.StatusCode
READ, ADMIN = "r3ad-secret", "adm1n-secret"


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


@pytest.fixture
def guarded(start_store):
    store = start_store(read_token=READ, admin_token=ADMIN)
    with StoreClient(store.address, token=ADMIN) as admin:
        admin.register("a", "peft-qv-r8")
    return store


def test_reads_need_the_read_token(guarded) -> None:
    with grpc.insecure_channel(guarded.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        reads = {
            "GetAdapter": lambda md: stub.GetAdapter(
                store_pb2.GetAdapterRequest(adapter_id="a"), metadata=md
            ),
            "ListAdapters": lambda md: stub.ListAdapters(store_pb2.ListAdaptersRequest(), metadata=md),
            "FetchAdapter": lambda md: list(
                stub.FetchAdapter(store_pb2.FetchAdapterRequest(adapter_id="a"), metadata=md)
            ),
        }
        for name, call in reads.items():
            expect_error(lambda c=call: c(None), C.UNAUTHENTICATED, name, "Bearer")
            expect_error(lambda c=call: c(_bearer("nope")), C.PERMISSION_DENIED, "not valid")
            assert call(_bearer(READ)) and call(_bearer(ADMIN))  # the admin token reads too
        # the read token is no admin token
        register = store_pb2.RegisterAdapterRequest(adapter_id="b", source="peft-qv-r8")
        expect_error(lambda: stub.RegisterAdapter(register, metadata=_bearer(READ)), C.PERMISSION_DENIED)
        delete = store_pb2.DeleteAdapterRequest(adapter_id="a")
        expect_error(lambda: stub.DeleteAdapter(delete, metadata=_bearer(READ)), C.PERMISSION_DENIED)
    with StoreClient(guarded.address, token=READ) as reader:
        assert reader.fetch("a").rank == 8 and [a.adapter_id for a in reader.list()] == ["a"]


def test_a_worker_presents_its_store_token(guarded, tiny_model_dir: Path) -> None:
    from loraserve.inference_worker.server import BackgroundWorker

    for token, expected in ((READ, None), (None, "UNAUTHENTICATED"), ("wrong", "PERMISSION_DENIED")):
        bg = BackgroundWorker(
            worker_config(tiny_model_dir, store_address=guarded.address, store_token=token, num_kv_blocks=32)
        )
        try:
            with WorkerClient(bg.address, timeout=60) as w:
                if expected is None:
                    assert w.generate([5, 17], adapter_id="a", max_tokens=2).adapter_digest
                else:
                    with pytest.raises(grpc.RpcError) as err:
                        w.generate([5, 17], adapter_id="a", max_tokens=2)
                    assert err.value.code() not in (C.INTERNAL, C.UNKNOWN, C.OK)
                    assert expected in err.value.details() or "token" in err.value.details(), (
                        err.value.details()
                    )
        finally:
            bg.stop()
