"""Calls on a store stub that many tests make: registering an adapter, and expecting a status."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from loraserve.v1 import store_pb2


def register(stub, adapter_id: str, source: str, overwrite: bool = False):
    return stub.RegisterAdapter(
        store_pb2.RegisterAdapterRequest(adapter_id=adapter_id, source=source, overwrite=overwrite)
    )


def expect_error(call: Callable[[], object], code: grpc.StatusCode, *fragments: str) -> str:
    """Run `call`, assert it fails with `code` and a message holding every fragment; -> the message."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    for f in fragments:
        assert f in err.value.details(), (f, err.value.details())
    return err.value.details()
