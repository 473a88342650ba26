"""The bad-input matrix: every malformed id, source or checkpoint gets its exact status code and a
message naming the problem, and the store keeps serving a good adapter afterwards."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import grpc
import pytest
import torch

from loraserve.clients.adapter_fetch import fetch_adapter
from loraserve.v1 import store_pb2, store_pb2_grpc
from tests.helpers import bad_checkpoints as bad
from tests.helpers.store_calls import expect_error, register

C = grpc.StatusCode


def still_serving(stub) -> None:
    info = stub.GetAdapter(store_pb2.GetAdapterRequest(adapter_id="good"))
    assert fetch_adapter(stub, "good").digest == info.digest


@pytest.fixture
def good_stub(stub):
    register(stub, "good", "peft-qv-r8")
    return stub


def _copy(root: Path, name: str, src: str = "peft-qv-r8") -> Path:
    return bad.copy_adapter(root / src, root / name)


# (case id, setup(root) -> source, expected code, message fragments)
def _shape(root: Path) -> str:
    d = _copy(root, "bad-shape")
    name = bad.first_name(d, "lora_A.weight")
    bad.edit_tensors(d, lambda t: t.__setitem__(name, torch.zeros(8, 65)))
    return "bad-shape"


def _int_dtype(root: Path) -> str:
    d = _copy(root, "int-dtype")
    name = bad.first_name(d, "lora_A.weight")
    bad.edit_tensors(d, lambda t: t.__setitem__(name, torch.zeros(8, 64, dtype=torch.int32)))
    return "int-dtype"


def _layer_out_of_range(root: Path) -> str:
    d = _copy(root, "layer-oob")

    def fn(t):
        for k in list(t):
            if ".layers.0." in k:
                t[k.replace(".layers.0.", ".layers.7.")] = t.pop(k)

    bad.edit_tensors(d, fn)
    return "layer-oob"


def _unexpected_tensor(root: Path) -> str:
    d = _copy(root, "extra-tensor")
    bad.edit_tensors(d, lambda t: t.__setitem__("base_model.model.model.something.weight", torch.zeros(2)))
    return "extra-tensor"


def _missing_b(root: Path) -> str:
    d = _copy(root, "missing-b")
    name = bad.first_name(d, "lora_B.weight")
    bad.edit_tensors(d, lambda t: t.pop(name))
    return "missing-b"


def _truncated(root: Path) -> str:
    d = _copy(root, "truncated")
    blob = (d / bad.WEIGHTS).read_bytes()
    (d / bad.WEIGHTS).write_bytes(blob[: len(blob) - 100])
    return "truncated"


def _header_cut(root: Path) -> str:
    d = _copy(root, "header-cut")
    (d / bad.WEIGHTS).write_bytes((d / bad.WEIGHTS).read_bytes()[:40])
    return "header-cut"


def _corrupt_header(root: Path) -> str:
    d = _copy(root, "corrupt")
    blob = bytearray((d / bad.WEIGHTS).read_bytes())
    blob[10:30] = b"\xff" * 20
    (d / bad.WEIGHTS).write_bytes(bytes(blob))
    return "corrupt"


def _huge_tensor(root: Path) -> str:
    d = _copy(root, "huge")
    header, data = bad.raw_header(d)
    name = next(k for k in header if k.endswith("lora_A.weight"))
    header[name]["shape"] = [1 << 40, 64]
    bad.write_raw_safetensors(d / bad.WEIGHTS, header, data)
    return "huge"


def _offsets_beyond(root: Path) -> str:
    d = _copy(root, "beyond")
    header, data = bad.raw_header(d)
    name = next(k for k in header if k.endswith("lora_A.weight"))
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [len(data) + 8, len(data) + 8 + end - begin]
    bad.write_raw_safetensors(d / bad.WEIGHTS, header, data)
    return "beyond"


def _overlap(root: Path) -> str:
    d = _copy(root, "overlap")
    header, data = bad.raw_header(d)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    a, b = names[0], names[1]
    if (
        header[a]["data_offsets"][1] - header[a]["data_offsets"][0]
        == header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
    ):
        header[b]["data_offsets"] = list(header[a]["data_offsets"])
    else:
        header[b]["data_offsets"] = [
            header[a]["data_offsets"][0],
            header[a]["data_offsets"][0] + header[b]["data_offsets"][1] - header[b]["data_offsets"][0],
        ]
    bad.write_raw_safetensors(d / bad.WEIGHTS, header, data)
    return "overlap"


def _nan(root: Path) -> str:
    bad.set_nan(_copy(root, "nan"), float("nan"))
    return "nan"


def _inf(root: Path) -> str:
    bad.set_nan(_copy(root, "inf"), float("inf"))
    return "inf"


def _bin_only(root: Path) -> str:
    d = _copy(root, "pickled")
    (d / bad.WEIGHTS).unlink()
    (d / "adapter_model.bin").write_bytes(b"\x80\x04pickle would go here")
    return "pickled"


def _rank_pattern_shape(root: Path) -> str:
    # rank_pattern declares rank 4 for v_proj but the tensors carry rank 8
    bad.edit_config(_copy(root, "pattern-mismatch"), rank_pattern={"v_proj": 4})
    return "pattern-mismatch"


def _bad_config_json(root: Path) -> str:
    d = _copy(root, "bad-json")
    (d / bad.CONFIG).write_text("{not json")
    return "bad-json"


def _bad_pattern_regex(root: Path) -> str:
    bad.edit_config(_copy(root, "bad-regex"), rank_pattern={"(v_proj": 4})
    return "bad-regex"


def _dora(root: Path) -> str:
    bad.edit_config(_copy(root, "dora"), use_dora=True)
    return "dora"


def _pissa(root: Path) -> str:
    bad.edit_config(_copy(root, "pissa"), init_lora_weights="pissa_niter_4")
    return "pissa"


def _qalora(root: Path) -> str:
    bad.edit_config(_copy(root, "qalora"), use_qalora=True)
    return "qalora"


def _other_peft_type(root: Path) -> str:
    bad.edit_config(_copy(root, "ia3"), peft_type="IA3")
    return "ia3"


def _modules_to_save(root: Path) -> str:
    bad.edit_config(_copy(root, "mts"), modules_to_save=["lm_head"])
    return "mts"


def _embed_target(root: Path) -> str:
    return "peft-embed"


def _embed_tensor_only(root: Path) -> str:
    d = _copy(root, "lm-head-tensor")
    bad.edit_tensors(d, lambda t: t.__setitem__("base_model.model.lm_head.lora_A.weight", torch.zeros(8, 64)))
    return "lm-head-tensor"


def _missing_dir(root: Path) -> str:
    return "no-such-adapter"


def _traversal(root: Path) -> str:
    return "../outside"


def _traversal_nested(root: Path) -> str:
    return "peft-qv-r8/../../outside"


def _absolute_outside(root: Path) -> str:
    return "/etc"


def _symlink_dir(root: Path) -> str:
    outside = root.parent / "outside-adapter"
    bad.copy_adapter(root / "peft-qv-r8", outside)
    os.symlink(outside, root / "link-out")
    return "link-out"


def _symlink_file(root: Path) -> str:
    d = _copy(root, "file-link")
    outside = root.parent / "outside.safetensors"
    (d / bad.WEIGHTS).rename(outside)
    os.symlink(outside, d / bad.WEIGHTS)
    return "file-link"


def _unknown_scheme(root: Path) -> str:
    return "http://example.com/adapter"


CASES = [
    ("shape", _shape, C.INVALID_ARGUMENT, ["lora_A.weight", "shape [8, 65]", "expected [8, 64]"]),
    ("int-dtype", _int_dtype, C.INVALID_ARGUMENT, ["lora_A.weight", "dtype 'I32'"]),
    ("layer-out-of-range", _layer_out_of_range, C.INVALID_ARGUMENT, ["layers.7", "layer 7", "has 2"]),
    ("unexpected-tensor", _unexpected_tensor, C.INVALID_ARGUMENT, ["unexpected tensor", "something.weight"]),
    ("missing-lora-b", _missing_b, C.INVALID_ARGUMENT, ["lora_B.weight is missing"]),
    ("truncated", _truncated, C.INVALID_ARGUMENT, ["lora_", "truncated or corrupt"]),
    ("header-cut", _header_cut, C.INVALID_ARGUMENT, ["header claims", "truncated or corrupt"]),
    ("corrupt-header", _corrupt_header, C.INVALID_ARGUMENT, ["header"]),
    (
        "huge-tensor",
        _huge_tensor,
        C.INVALID_ARGUMENT,
        ["lora_A.weight", "claims 281474976710656 bytes", "file holds only"],
    ),
    ("offsets-beyond-file", _offsets_beyond, C.INVALID_ARGUMENT, ["lora_A.weight", "outside the"]),
    ("overlapping", _overlap, C.INVALID_ARGUMENT, ["overlap"]),
    ("nan", _nan, C.INVALID_ARGUMENT, ["lora_B.weight", "NaN or Inf"]),
    ("inf", _inf, C.INVALID_ARGUMENT, ["lora_B.weight", "NaN or Inf"]),
    ("bin-only", _bin_only, C.INVALID_ARGUMENT, ["adapter_model.bin", "pickle", "safe_serialization=True"]),
    ("rank-pattern-shape", _rank_pattern_shape, C.INVALID_ARGUMENT, ["v_proj.lora_A.weight", "rank 4"]),
    ("config-not-json", _bad_config_json, C.INVALID_ARGUMENT, ["adapter_config.json", "not valid JSON"]),
    ("pattern-not-regex", _bad_pattern_regex, C.INVALID_ARGUMENT, ["rank_pattern key '(v_proj'"]),
    ("dora", _dora, C.FAILED_PRECONDITION, ["DoRA"]),
    (
        "pissa-init",
        _pissa,
        C.FAILED_PRECONDITION,
        ["init_lora_weights='pissa_niter_4'", "base model's weights"],
    ),
    ("qalora", _qalora, C.FAILED_PRECONDITION, ["use_qalora"]),
    ("other-peft-type", _other_peft_type, C.FAILED_PRECONDITION, ["peft_type 'IA3'"]),
    ("modules-to-save", _modules_to_save, C.FAILED_PRECONDITION, ["modules_to_save", "lm_head"]),
    ("embed-tokens-target", _embed_target, C.FAILED_PRECONDITION, ["embed_tokens"]),
    ("lm-head-tensor", _embed_tensor_only, C.FAILED_PRECONDITION, ["lm_head.lora_A.weight"]),
    ("missing-source", _missing_dir, C.NOT_FOUND, ["no-such-adapter", "adapter_model.safetensors not found"]),
    ("traversal", _traversal, C.INVALID_ARGUMENT, ["'../outside'", "outside the adapter root"]),
    ("traversal-nested", _traversal_nested, C.INVALID_ARGUMENT, ["outside the adapter root"]),
    ("absolute-outside", _absolute_outside, C.INVALID_ARGUMENT, ["'/etc'", "outside the adapter root"]),
    ("symlink-dir-out", _symlink_dir, C.INVALID_ARGUMENT, ["'link-out'", "outside the adapter root"]),
    (
        "symlink-file-out",
        _symlink_file,
        C.INVALID_ARGUMENT,
        ["adapter_model.safetensors", "symlink", "leaves the adapter root"],
    ),
    ("unknown-scheme", _unknown_scheme, C.INVALID_ARGUMENT, ["only s3:// URLs"]),
]


@pytest.mark.parametrize("setup,code,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_checkpoint(setup, code, fragments, good_stub, adapter_root: Path) -> None:
    source = setup(adapter_root)
    expect_error(lambda: register(good_stub, "candidate", source), code, *fragments)
    expect_error(
        lambda: good_stub.GetAdapter(store_pb2.GetAdapterRequest(adapter_id="candidate")), C.NOT_FOUND
    )
    still_serving(good_stub)


@pytest.mark.parametrize("adapter_id", ["", "-lead", "has/slash", "../etc", "a..b", "x" * 129, "sp ace", "é"])
def test_malformed_ids(adapter_id: str, good_stub) -> None:
    expect_error(
        lambda: register(good_stub, adapter_id, "peft-qv-r8"), C.INVALID_ARGUMENT, "adapter id", "malformed"
    )
    expect_error(
        lambda: good_stub.GetAdapter(store_pb2.GetAdapterRequest(adapter_id=adapter_id)),
        C.INVALID_ARGUMENT,
        "adapter id",
    )
    still_serving(good_stub)


def test_unknown_adapter(good_stub) -> None:
    for call in (
        lambda: good_stub.GetAdapter(store_pb2.GetAdapterRequest(adapter_id="nope")),
        lambda: good_stub.DeleteAdapter(store_pb2.DeleteAdapterRequest(adapter_id="nope")),
        lambda: fetch_adapter(good_stub, "nope"),
    ):
        expect_error(call, C.NOT_FOUND, "'nope'", "not registered")
    still_serving(good_stub)


def test_id_taken_then_overwrite(good_stub) -> None:
    expect_error(
        lambda: register(good_stub, "good", "peft-all-r16-rslora"), C.ALREADY_EXISTS, "'good'", "overwrite"
    )
    old = good_stub.GetAdapter(store_pb2.GetAdapterRequest(adapter_id="good"))
    new = register(good_stub, "good", "peft-all-r16-rslora", overwrite=True)
    assert new.digest != old.digest and new.rank == 16
    assert fetch_adapter(good_stub, "good").digest == new.digest


def test_rank_over_limit(start_store) -> None:
    store = start_store(max_lora_rank=8)
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        expect_error(
            lambda: register(stub, "big", "peft-all-r16-rslora"),
            C.INVALID_ARGUMENT,
            "rank 16",
            "exceeds max_lora_rank 8",
        )
        assert register(stub, "ok", "peft-qv-r8").rank == 8


def test_other_base_model(start_store, make_demo, adapter_root: Path) -> None:
    bad.edit_config(make_demo("other-base"), base_model_name_or_path="meta-llama/Llama-3.1-8B")
    # peft records the local base directory; its last component must name this store's base model
    bad.edit_config(make_demo("same-base"), base_model_name_or_path="/models/tiny-llama")
    store = start_store(check_base_model=True)
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        expect_error(
            lambda: register(stub, "x", "other-base"),
            C.FAILED_PRECONDITION,
            "'meta-llama/Llama-3.1-8B'",
            "tiny-llama",
        )
        assert register(stub, "y", "same-base").base_model == "/models/tiny-llama"


def test_size_and_count_limits(start_store) -> None:
    store = start_store(max_adapter_bytes=1000, max_tensors=3)
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        expect_error(
            lambda: register(stub, "x", "peft-qv-r8"),
            C.INVALID_ARGUMENT,
            "adapter_model.safetensors is",
            "over the limit of 1000",
        )
    store = start_store(max_tensors=3)
    with grpc.insecure_channel(store.address) as ch:
        stub = store_pb2_grpc.AdapterStoreStub(ch)
        expect_error(
            lambda: register(stub, "x", "peft-qv-r8"), C.INVALID_ARGUMENT, "holds 8 tensors", "limit of 3"
        )


def test_fetch_offset_and_page_token(good_stub) -> None:
    info = good_stub.GetAdapter(store_pb2.GetAdapterRequest(adapter_id="good"))
    expect_error(
        lambda: list(
            good_stub.FetchAdapter(
                store_pb2.FetchAdapterRequest(adapter_id="good", offset=info.size_bytes + 1)
            )
        ),
        C.INVALID_ARGUMENT,
        "offset",
        "outside the payload",
    )
    expect_error(
        lambda: good_stub.ListAdapters(store_pb2.ListAdaptersRequest(page_token="!!!")),
        C.INVALID_ARGUMENT,
        "page_token",
    )
    still_serving(good_stub)


def test_header_length_field_is_checked_before_parsing(good_stub, adapter_root: Path) -> None:
    d = _copy(adapter_root, "giant-header")
    blob = (d / bad.WEIGHTS).read_bytes()
    (d / bad.WEIGHTS).write_bytes(struct.pack("<Q", 1 << 62) + blob[8:])
    expect_error(lambda: register(good_stub, "g", "giant-header"), C.INVALID_ARGUMENT, "header claims")
    still_serving(good_stub)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_non_finite_values_are_found_whatever_a_tensor_sums_to(dtype: torch.dtype) -> None:
    """check_finite sums each tensor first: finite values whose float32 sum overflows are then
    looked at one by one and pass; NaN, Inf, -Inf, and Inf beside -Inf (a NaN sum) are found."""
    from loraserve.adapter_store.checkpoint import check_finite
    from loraserve.adapter_store.errors import InvalidArgument

    check_finite({"w": torch.full((4, 4), min(torch.finfo(dtype).max, 1e300), dtype=dtype)})
    for values in ([float("nan")], [float("inf")], [float("-inf")], [float("inf"), float("-inf")]):
        t = torch.zeros(4, 4, dtype=dtype)
        t.view(-1)[: len(values)] = torch.tensor(values, dtype=dtype)
        with pytest.raises(InvalidArgument, match="'w' contains NaN or Inf"):
            check_finite({"ok": torch.ones(3, dtype=dtype), "w": t})
