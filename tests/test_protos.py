"""The generated stubs import as `loraserve.v1` and describe both services completely."""

from loraserve.v1 import adapter_pb2, store_pb2, store_pb2_grpc, worker_pb2, worker_pb2_grpc


def test_store_service_methods() -> None:
    service = store_pb2.DESCRIPTOR.services_by_name["AdapterStore"]
    assert {m.name for m in service.methods} == {
        "RegisterAdapter",
        "GetAdapter",
        "ListAdapters",
        "DeleteAdapter",
        "FetchAdapter",
    }
    assert service.methods_by_name["FetchAdapter"].server_streaming
    assert hasattr(store_pb2_grpc, "AdapterStoreStub")


def test_worker_service_methods() -> None:
    service = worker_pb2.DESCRIPTOR.services_by_name["InferenceWorker"]
    assert {m.name for m in service.methods} == {
        "Generate",
        "GenerateStream",
        "LoadAdapter",
        "UnloadAdapter",
        "PinAdapter",
        "ListAdapters",
        "GetWorkerInfo",
    }
    assert service.methods_by_name["GenerateStream"].server_streaming
    assert hasattr(worker_pb2_grpc, "InferenceWorkerStub")


def test_enums_start_unspecified() -> None:
    for enum in (worker_pb2.FinishReason, worker_pb2.AdapterTier, adapter_pb2.AdapterState):
        assert enum.Name(0).endswith("_UNSPECIFIED")
