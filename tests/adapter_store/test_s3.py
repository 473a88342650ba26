"""Sources in S3, through moto's standalone server and boto3 with endpoint_url."""

from __future__ import annotations

import boto3
import grpc
import pytest

from loraserve.clients.adapter_fetch import fetch_adapter
from loraserve.v1 import store_pb2, store_pb2_grpc
from tests.helpers.ports import free_port
from tests.helpers.store_calls import expect_error, register

pytestmark = pytest.mark.s3
C = grpc.StatusCode


@pytest.fixture
def s3_stub(start_store, s3_endpoint: str, s3_bucket: str):
    # no disk tier: a CPU cache miss rebuilds from S3 (test_disk_tier.py serves S3 adapters from disk)
    store = start_store(
        s3_endpoint_url=s3_endpoint, s3_region="us-east-1", cache_max_adapters=1, cache_dir=""
    )
    with grpc.insecure_channel(store.address) as ch:
        yield store_pb2_grpc.AdapterStoreStub(ch)


def test_register_and_fetch_from_s3(s3_stub) -> None:
    s3_info = register(s3_stub, "from-s3", "s3://adapters/team-a/peft-patterns")
    local_info = register(s3_stub, "from-disk", "peft-patterns")
    assert s3_info.digest == local_info.digest and s3_info.source == "s3://adapters/team-a/peft-patterns"
    # cache_max_adapters=1: "from-s3" was evicted by "from-disk", so this fetch rebuilds from S3
    assert fetch_adapter(s3_stub, "from-s3").digest == s3_info.digest


def test_missing_key_and_bucket(s3_stub) -> None:
    expect_error(
        lambda: register(s3_stub, "x", "s3://adapters/team-a/nothing-here"),
        C.NOT_FOUND,
        "s3://adapters/team-a/nothing-here",
        "adapter_model.safetensors not found",
    )
    expect_error(lambda: register(s3_stub, "x", "s3://no-such-bucket/a"), C.NOT_FOUND, "no-such-bucket")
    assert register(s3_stub, "ok", "s3://adapters/team-a/peft-qv-r8").rank == 8


def test_missing_config_only(s3_stub, s3_endpoint: str, peft_root) -> None:
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    s3.upload_file(
        str(peft_root / "peft-qv-r8" / "adapter_model.safetensors"),
        "adapters",
        "team-b/no-config/adapter_model.safetensors",
    )
    expect_error(
        lambda: register(s3_stub, "x", "s3://adapters/team-b/no-config"),
        C.NOT_FOUND,
        "team-b/no-config/adapter_config.json",
    )


def test_pickle_only_in_s3(s3_stub, s3_endpoint: str) -> None:
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    s3.put_object(Bucket="adapters", Key="team-b/pickled/adapter_model.bin", Body=b"\x80\x04...")
    s3.put_object(Bucket="adapters", Key="team-b/pickled/adapter_config.json", Body=b"{}")
    expect_error(
        lambda: register(s3_stub, "x", "s3://adapters/team-b/pickled"),
        C.INVALID_ARGUMENT,
        "pickle",
        "safetensors",
    )


@pytest.mark.parametrize(
    "source",
    [
        "s3://adapters/team-a/../secrets",
        "s3://Bad_Bucket/x",
        "s3://adapters/a//..",
        "s3://adapters/a/%2e%2e/b",
        "s3://a/x",
    ],
)
def test_keys_only_from_validated_parts(s3_stub, source: str) -> None:
    expect_error(lambda: register(s3_stub, "x", source), C.INVALID_ARGUMENT, "source")


def test_s3_unreachable(start_store, s3_bucket: str) -> None:
    store = start_store(s3_endpoint_url=f"http://127.0.0.1:{free_port()}", s3_timeout_s=1.0)
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        expect_error(
            lambda: register(stub, "x", "s3://adapters/team-a/peft-qv-r8"),
            C.UNAVAILABLE,
            "S3 endpoint unreachable",
            "s3://adapters/team-a/peft-qv-r8",
        )
        assert register(stub, "local", "peft-qv-r8").rank == 8
        assert stub.GetAdapter(store_pb2.GetAdapterRequest(adapter_id="local")).adapter_id == "local"


def test_s3_file_over_the_limit(start_store, s3_endpoint: str, s3_bucket: str) -> None:
    store = start_store(s3_endpoint_url=s3_endpoint, s3_region="us-east-1", max_adapter_bytes=1000)
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        expect_error(
            lambda: register(stub, "x", "s3://adapters/team-a/peft-qv-r8"),
            C.INVALID_ARGUMENT,
            "s3://adapters/team-a/peft-qv-r8/adapter_model.safetensors is",
            "over the limit of 1000",
        )
