"""Checkpoints and identifiers built to hurt the store: pattern keys that would backtrack as
regular expressions, nesting deep enough to exhaust a recursive parser, ids and S3 names with a
trailing newline, alphas that are no scale at all, finite weights whose update no activation
holds. Each is refused with INVALID_ARGUMENT and a message naming what is wrong, quickly, while
health keeps answering."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import grpc
import pytest
import torch

from loraserve.adapter_store.checkpoint import MAX_JSON_DEPTH, PeftCheckpoint, parse_config, parse_header
from loraserve.adapter_store.errors import InvalidArgument
from loraserve.adapter_store.ids import check_adapter_id
from loraserve.adapter_store.optimize import optimize
from loraserve.adapter_store.pattern_keys import check_pattern_key, key_matches
from loraserve.adapter_store.sources import parse_s3
from loraserve.adapter_store.validate import Limits, activation_limit, module_path, update_bound, validate
from loraserve.contract.adapter_layout import MODULES, module_shapes
from loraserve.contract.payload import TORCH_DTYPES
from loraserve.v1 import store_pb2
from tests.helpers import bad_checkpoints as bad
from tests.helpers.health import HealthProbe

C = grpc.StatusCode
# Backtracks exponentially in PEFT's `(.*\.)?(KEY)$` against any module path.
EVIL_KEY = "((.+)+)+Z"


def register(stub, adapter_id: str, source: str, timeout: float = 30):
    return stub.RegisterAdapter(
        store_pb2.RegisterAdapterRequest(adapter_id=adapter_id, source=source), timeout=timeout
    )


def refused(stub, source: str, *fragments: str, code: grpc.StatusCode = C.INVALID_ARGUMENT) -> str:
    with pytest.raises(grpc.RpcError) as err:
        register(stub, "candidate", source)
    assert err.value.code() == code, err.value.details()
    for f in fragments:
        assert f in err.value.details(), (f, err.value.details())
    return err.value.details()


# -- defect: pattern keys compiled into regular expressions -------------------------------------
def test_backtracking_pattern_key_is_refused_without_a_regex(stub, adapter_root: Path) -> None:
    bad.edit_config(
        bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "evil"), rank_pattern={EVIL_KEY: 4}
    )
    t0 = time.monotonic()
    refused(stub, "evil", f"rank_pattern key {EVIL_KEY!r}", "not accepted")
    assert time.monotonic() - t0 < 5


def test_health_answers_while_a_pathological_checkpoint_is_validated(store, adapter_root: Path) -> None:
    """Register checkpoints that are slow or hostile to validate while health is polled: every
    health call answers within 1 s, and each registration is refused with INVALID_ARGUMENT."""
    d = bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "evil-alpha")
    bad.edit_config(d, alpha_pattern={EVIL_KEY: 4.0, "a" * 200: 1.0})
    # a 7 MiB header: one tensor entry per name, far past max_tensors; refused by its size before parsing
    d2 = bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "huge-header")
    header, data = bad.raw_header(d2)
    for i in range(60_000):
        header[f"base_model.model.model.layers.0.mlp.down_proj.x{i}.lora_A.weight"] = {
            "dtype": "F32",
            "shape": [0],
            "data_offsets": [0, 0],
        }
    bad.write_raw_safetensors(d2 / bad.WEIGHTS, header, data)
    with HealthProbe(store.address) as probe, grpc.insecure_channel(store.address) as ch:
        from loraserve.v1 import store_pb2_grpc

        s = store_pb2_grpc.AdapterStoreStub(ch)
        for source, fragment in (("evil-alpha", EVIL_KEY), ("huge-header", "over the limit")):
            details = refused(s, source)
            assert fragment in details, details
    assert probe.latencies and max(probe.latencies) < 1.0, probe.latencies


PEFT_KEYS = [
    "down_proj",
    "mlp.down_proj",
    "q_proj",
    "self_attn.q_proj",
    "layers.1.mlp.down_proj",
    "model.layers.0.self_attn.q_proj",
    "^model.layers.0.self_attn.q_proj",
    "^layers.0.self_attn.q_proj",
    "model\\.layers\\.1\\.self_attn\\.v_proj",
    "proj",
    "_proj",
    "1.mlp.up_proj",
]


@pytest.mark.parametrize("key", PEFT_KEYS)
def test_accepted_keys_match_like_peft(key: str) -> None:
    """On every key we accept, our string match agrees with PEFT's own regex rule (the oracle:
    these keys are ours, not a checkpoint's)."""
    from peft.utils.other import get_pattern_key

    assert check_pattern_key(key) is None
    for layer in range(12):
        for module in MODULES:
            path = module_path(layer, module)
            assert key_matches(key, path) == (get_pattern_key([key], path) == key), (key, path)


@pytest.mark.parametrize(
    "key",
    [EVIL_KEY, "(v_proj", ".*q_proj", "q_proj|v_proj", "layers.[0-9].mlp", "a" * 257, "", "x..y", "q_proj$"],
)
def test_other_keys_are_refused(key: str) -> None:
    problem = check_pattern_key(key)
    assert problem is not None and (repr(key) in problem or repr(key[:40]) in problem), problem


# -- defect: deeply nested JSON ------------------------------------------------------------------
def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5_000, 200_000])
def test_deeply_nested_config_is_invalid_argument(depth: int) -> None:
    with pytest.raises(InvalidArgument, match="nests deeper than"):
        parse_config(f'{{"r": 8, "x": {_nested(depth)}}}'.encode())


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 200_000])
def test_deeply_nested_header_is_invalid_argument(depth: int) -> None:
    raw = f'{{"__metadata__": {_nested(depth)}}}'.encode()
    with pytest.raises(InvalidArgument, match="nests deeper than"):
        parse_header(struct.pack("<Q", len(raw)) + raw, max_tensors=4096)


def test_nested_json_over_grpc_is_invalid_argument(stub, adapter_root: Path) -> None:
    d = bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "deep-config")
    cfg = (d / bad.CONFIG).read_text()
    (d / bad.CONFIG).write_text(cfg[:-1] + f', "deep": {_nested(100_000)}}}')
    refused(stub, "deep-config", "adapter_config.json", "nests deeper")
    d = bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "deep-header")
    header, data = bad.raw_header(d)
    raw = json.dumps(header).encode()[:-1] + f', "__metadata__": {_nested(100_000)}}}'.encode()
    (d / bad.WEIGHTS).write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    refused(stub, "deep-header", "adapter_model.safetensors header", "nests deeper")


# -- defect: `$` matching before a trailing newline -----------------------------------------------
@pytest.mark.parametrize("adapter_id", ["good\n", "a\n", "x" * 127 + "\n"])
def test_adapter_id_with_trailing_newline_is_refused(adapter_id: str, stub) -> None:
    with pytest.raises(InvalidArgument, match="malformed"):
        check_adapter_id(adapter_id)
    with pytest.raises(grpc.RpcError) as err:
        register(stub, adapter_id, "peft-qv-r8")
    assert err.value.code() == C.INVALID_ARGUMENT and "adapter id" in err.value.details()


@pytest.mark.parametrize("source", ["s3://bucket\n/team/x", "s3://bucket/team\n/x", "s3://bucket/team/x\n"])
def test_s3_names_with_trailing_newline_are_refused(source: str) -> None:
    with pytest.raises(InvalidArgument, match="not a valid S3 bucket name|is not allowed"):
        parse_s3(source)


def test_worker_refuses_adapter_ids_with_trailing_newline() -> None:
    from loraserve.inference_worker.adapters.refs import AdapterRef
    from loraserve.inference_worker.errors import InvalidRequest

    for ref in ("good\n", "good@" + "0" * 64 + "\n"):
        with pytest.raises(InvalidRequest):
            AdapterRef.parse(ref)


# -- defect: lora_alpha that is no scale -----------------------------------------------------------
@pytest.mark.parametrize(
    "changes,fragment",
    [
        ({"lora_alpha": 0}, "lora_alpha must be a finite number > 0, got 0"),
        ({"lora_alpha": -16}, "lora_alpha must be a finite number > 0, got -16"),
        ({"alpha_pattern": {"v_proj": 0.0}}, "alpha_pattern['v_proj'] must be a finite number > 0"),
        ({"alpha_pattern": {"v_proj": -2}}, "alpha_pattern['v_proj'] must be a finite number > 0"),
    ],
)
def test_non_positive_alpha_is_refused(changes: dict, fragment: str, stub, adapter_root: Path) -> None:
    bad.edit_config(bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "alpha"), **changes)
    refused(stub, "alpha", fragment)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_alpha_is_refused(literal: str, stub, adapter_root: Path) -> None:
    d = bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "alpha-nf")
    cfg = json.loads((d / bad.CONFIG).read_text())
    cfg["lora_alpha"] = "ALPHA"
    (d / bad.CONFIG).write_text(json.dumps(cfg).replace('"ALPHA"', literal))
    refused(stub, "alpha-nf", "lora_alpha must be a finite number > 0")


# -- defect: numbers and names past Python's int/float conversions -------------------------------
def _rename_first(d: Path, old: str, new: str) -> None:
    header, data = bad.raw_header(d)
    name = next(k for k in header if old in k)
    header[name.replace(old, new)] = header.pop(name)
    bad.write_raw_safetensors(d / bad.WEIGHTS, header, data)


@pytest.mark.parametrize(
    "literal,fragment",
    [
        ("9" * 5000, "adapter_config.json"),  # past int()'s 4,300-digit limit in the JSON parser
        (str(10**400), "lora_alpha must be a finite number > 0"),  # an int too large for a float
    ],
    ids=["5000-digits", "1e400"],
)
def test_alpha_past_float_range_is_refused(literal: str, fragment: str, stub, adapter_root: Path) -> None:
    d = bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "alpha-big")
    cfg = json.loads((d / bad.CONFIG).read_text())
    cfg["lora_alpha"] = "ALPHA"
    (d / bad.CONFIG).write_text(json.dumps(cfg).replace('"ALPHA"', literal))
    refused(stub, "alpha-big", fragment)


def test_header_number_past_int_digit_limit_is_refused(stub, adapter_root: Path) -> None:
    d = bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "dim-big")
    header, data = bad.raw_header(d)
    raw = json.dumps(header).encode().replace(b'"shape": [8, 64]', b'"shape": [' + b"9" * 5000 + b", 64]", 1)
    (d / bad.WEIGHTS).write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    refused(stub, "dim-big", "adapter_model.safetensors header")


@pytest.mark.parametrize(
    "layer",
    ["9" * 5000, "00", "01", "\u0661", "\uff11"],  # huge, leading zeros, Arabic-Indic and full-width digits
    ids=["5000-digits", "00", "01", "arabic-indic-1", "fullwidth-1"],
)
def test_layer_index_must_be_plain_decimal(layer: str, stub, adapter_root: Path) -> None:
    """A layer index is the decimal PEFT writes: one name per module, so no two tensors can stand
    for the same weight (layers.1 and layers.01) and no index is parsed past the limits of int()."""
    d = bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "layer-name")
    _rename_first(d, ".layers.1.", f".layers.{layer}.")
    details = refused(stub, "layer-name", "layers.")
    assert len(details) < 2000, len(details)


def test_duplicate_module_under_two_names_is_refused(stub, adapter_root: Path) -> None:
    d = bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "dup-module")
    name = bad.first_name(d, "layers.1.self_attn.q_proj.lora_A.weight")
    bad.edit_tensors(d, lambda t: t.__setitem__(name.replace(".layers.1.", ".layers.01."), t[name] + 1))
    refused(stub, "dup-module", "layers.01.")


def test_huge_tensor_name_gets_a_bounded_message(stub, adapter_root: Path) -> None:
    """A 64 KiB tensor name is refused with a message short enough for a gRPC status (the
    client's metadata limit is 8 KiB by default)."""
    d = bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "long-name")
    _rename_first(d, "q_proj.lora_A", "q_proj" + "x" * 65536 + ".lora_A")
    details = refused(stub, "long-name", "a tensor name is", "characters, over the limit of 512")
    assert len(details) < 2000, len(details)


@pytest.mark.parametrize("field", ["r", "peft_type", "modules_to_save"])
def test_huge_config_value_gets_a_bounded_message(field: str, stub, adapter_root: Path) -> None:
    """A message that quotes a 100,000-character config value still reaches the client as the right status
    (cut to a size gRPC delivers), not RESOURCE_EXHAUSTED from the client's metadata limit."""
    d = bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "huge-value")
    bad.edit_config(d, **{field: "\u00e9" * 100_000})
    with pytest.raises(grpc.RpcError) as err:
        register(stub, "candidate", "huge-value")
    assert err.value.code() in (C.INVALID_ARGUMENT, C.FAILED_PRECONDITION), err.value.details()
    assert field in err.value.details() and err.value.details().endswith("...")


@pytest.mark.parametrize(
    "shape",
    [
        b"[" + b"9" * 4299 + b"]",
        b"[" + b"9" * 2200 + b", " + b"9" * 2200 + b"]",
        b"[0, " + b"9" * 4000 + b"]",
    ],
    ids=["one-4299-digit-dim", "two-2200-digit-dims", "zero-times-huge"],
)
def test_huge_dimension_is_refused_before_its_size_is_computed(
    shape: bytes, stub, adapter_root: Path
) -> None:
    """A size of more than 4,300 digits cannot be formatted into a message (int-to-str's limit):
    the dimensions are bounded first, and the refusal names the tensor."""
    d = bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "dim-huge")
    header, data = bad.raw_header(d)
    name = next(k for k in header if k.endswith("lora_A.weight"))
    header[name]["dtype"] = "F64"
    raw = json.dumps(header).encode().replace(b'"shape": [8, 64]', b'"shape": ' + shape, 1)
    (d / bad.WEIGHTS).write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    details = refused(stub, "dim-huge", name, "has a dimension over")
    assert len(details) < 2000, len(details)


def _weights(header: str, data: bytes) -> bytes:
    raw = header.encode()
    return struct.pack("<Q", len(raw)) + raw + data


def test_a_tensor_named_twice_in_the_header_is_refused(stub, adapter_root: Path) -> None:
    """json.loads keeps the last of repeated keys, so one of two tensors of the same name was
    dropped silently; the safetensors library refuses such a file, and so does the store."""
    d = bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "dup-key")
    header, data = bad.raw_header(d)
    name = next(k for k in header if k.endswith("lora_A.weight"))
    entry = json.dumps(header[name])
    raw = json.dumps(header)
    raw = raw[:-1] + f", {json.dumps(name)}: {entry}}}"  # the same name, range and all, again
    (d / bad.WEIGHTS).write_bytes(_weights(raw, data))
    refused(stub, "dup-key", "repeats the key", name)
    with pytest.raises(InvalidArgument, match="repeats the key 'dtype'"):
        parse_header(
            _weights(
                '{"t": {"dtype": "F32", "dtype": "F16", "shape": [1], "data_offsets": [0, 4]}}', bytes(4)
            ),
            max_tensors=8,
        )


@pytest.mark.parametrize(
    "header,size,fragment",
    [
        ('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', 8, "4 unused bytes at the start"),
        (
            '{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
            ' "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}',
            12,
            "4 unused bytes after tensor 'a', before tensor 'b'",
        ),
        ('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', 6, "2 bytes after its last tensor"),
        ('{"__metadata__": {}}', 4, "4 bytes after its last tensor"),
        (
            '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},'
            ' "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
            8,
            "overlap",
        ),
    ],
    ids=["gap-first", "gap-between", "trailing", "trailing-no-tensor", "overlap"],
)
def test_tensor_ranges_must_tile_the_data_section(header: str, size: int, fragment: str) -> None:
    with pytest.raises(InvalidArgument, match=fragment):
        parse_header(_weights(header, bytes(size)), max_tensors=8)


def test_ranges_that_tile_the_data_section_are_accepted() -> None:
    header = (
        '{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
        ' "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},'
        ' "b": {"dtype": "F16", "shape": [2], "data_offsets": [4, 8]}}'
    )
    entries, start = parse_header(_weights(header, bytes(8)), max_tensors=8)
    assert [e.name for e in entries] == ["a", "e", "b"] and start == 8 + len(header)


# -- defect: finite weights whose update overflows the activations --------------------------------
def _absurd(d: Path, which: str, how: str) -> str:
    name = bad.first_name(d, f"{which}.weight")

    def fn(t: dict) -> None:
        if how == "all":
            t[name] = t[name] * 1e30
        else:
            t[name] = t[name].clone()
            t[name][0, 0] = 1e30

    bad.edit_tensors(d, fn)
    return name


@pytest.mark.parametrize("which,how", [("lora_B", "all"), ("lora_A", "all"), ("lora_A", "one")])
def test_weights_whose_update_overflows_are_refused(which: str, how: str, stub, adapter_root: Path) -> None:
    """Finite weights of 1e30 (which bfloat16 holds) make the module's update for an input of
    magnitude 1 about 1e31: past what the next RMSNorm can square, so the adapter's rows come out
    as zeros or NaN while others are fine. Refused at registration, naming the tensors."""
    name = _absurd(bad.copy_adapter(adapter_root / "peft-qv-r8", adapter_root / "absurd"), which, how)
    module = name.rsplit(".", 2)[0]
    refused(stub, "absurd", f"{module}.lora_A.weight", f"{module}.lora_B.weight", "input of magnitude 1")


def _rank1(base_config: dict, a: float, b: float) -> PeftCheckpoint:
    """A rank-1 q_proj adapter of layer 0 with every A entry `a` and every B entry `b` (scale 1):
    its update of an all-ones input is a * b * in_features in every row, exactly."""
    in_f, out_f = module_shapes(base_config)["q_proj"]
    prefix = f"base_model.model.{module_path(0, 'q_proj')}"
    return PeftCheckpoint(
        {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": ["q_proj"]},
        {
            f"{prefix}.lora_A.weight": torch.full((1, in_f), a),
            f"{prefix}.lora_B.weight": torch.full((out_f, 1), b),
        },
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_bound_is_the_update_of_a_unit_input(dtype: str, base_config: dict) -> None:
    """Within 1 % either side of the limit: an update that the serving dtype (float16) or the next
    RMSNorm (bfloat16, float32: it squares in float32) still holds is accepted, one past it not."""
    in_f = module_shapes(base_config)["q_proj"][0]
    limit = activation_limit(dtype)
    limits = Limits(serving_dtype=dtype)
    ok = validate(_rank1(base_config, 1.0, 0.99 * limit / in_f), base_config, limits)
    assert optimize(ok, base_config, dtype).digest
    update = torch.ones(in_f) @ ok.modules[(0, "q_proj")].a.T @ ok.modules[(0, "q_proj")].b.T  # [out]
    assert bool(torch.isfinite(update.to(TORCH_DTYPES[dtype])).all())
    with pytest.raises(InvalidArgument, match="input of magnitude 1") as err:
        validate(_rank1(base_config, 1.0, 1.01 * limit / in_f), base_config, limits)
    assert "q_proj.lora_A.weight" in str(err.value) and dtype in str(err.value)


def test_past_the_limit_the_next_rmsnorm_loses_the_row() -> None:
    """Why bfloat16's limit is sqrt(float32 max), not bfloat16's max: the worker's RMSNorm squares
    activations in float32, and one past the limit turns the whole row's output to zeros."""
    from loraserve.inference_worker.model.llama import RMSNorm

    norm = RMSNorm(64, 1e-5, torch.bfloat16, "cpu")
    limit = activation_limit("bfloat16")
    for value, lost in ((0.5 * limit, False), (2 * limit, True)):
        x = torch.ones(1, 64, dtype=torch.bfloat16)
        x[0, 0] = value
        y, _ = norm(x)
        assert bool((y == 0).all()) == lost, (value, y)


def test_the_bound_holds_for_any_weights() -> None:
    """update_bound is never below the exact largest row sum of |scale * B @ A| (float32 rounding
    aside), and at most r times it; exact for rank 1."""
    g = torch.Generator().manual_seed(0)
    for r, in_f, out_f in ((1, 64, 32), (8, 64, 96), (16, 256, 128)):
        a = torch.randn(r, in_f, generator=g)
        b = torch.randn(out_f, r, generator=g) * torch.rand(out_f, 1, generator=g)
        exact = float((0.5 * b.double() @ a.double()).abs().sum(1).max())
        bound = update_bound(a, b, 0.5)
        assert exact * (1 - 1e-6) <= bound <= r * exact * (1 + 1e-6)
    # rows of A past float32 (which the shrink accumulates in): inf * 0 is NaN, even with B = 0
    assert update_bound(torch.full((1, 64), 1e37, dtype=torch.bfloat16), torch.zeros(8, 1), 1.0) == math.inf
