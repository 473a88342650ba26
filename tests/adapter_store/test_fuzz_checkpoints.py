"""Seeded mutations of a valid checkpoint (header bytes, tensor table, config fields, truncations)
through the store's read -> validate -> optimize pipeline: each either builds or fails with one of
the store's own errors (a status code and message), never another exception."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest

from loraserve.adapter_store.checkpoint import read_checkpoint
from loraserve.adapter_store.demo import DemoAdapterSpec, write_peft_adapter
from loraserve.adapter_store.errors import InvalidArgument, StoreError
from loraserve.adapter_store.optimize import optimize
from loraserve.adapter_store.validate import Limits, validate

CASES = 400


@pytest.fixture(scope="module")
def valid(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, bytes, bytes]:
    base = json.loads((tiny_model_dir / "config.json").read_text())
    spec = DemoAdapterSpec(
        "fuzz",
        r=4,
        lora_alpha=8,
        target_modules=("q_proj", "v_proj", "down_proj"),
        rank_pattern={"down_proj": 2},
    )
    d = write_peft_adapter(tmp_path_factory.mktemp("fuzz"), base, spec)
    return base, (d / "adapter_config.json").read_bytes(), (d / "adapter_model.safetensors").read_bytes()


_ODD_VALUES = [
    None,
    -1,
    0,
    1,
    3,
    10**12,
    1e308,
    float("nan"),
    "x",
    "",
    [],
    {},
    [1, 2],
    {"a": 1},
    True,
    "F16",
    "BF16",
    "I64",
    "q_proj",
    ["lm_head"],
    ["q_proj", 7],
]


def _mutate_header(weights: bytes, rng: random.Random) -> bytes:
    (n,) = struct.unpack("<Q", weights[:8])
    header = json.loads(weights[8 : 8 + n])
    body = weights[8 + n :]
    name = rng.choice([k for k in header if k != "__metadata__"])
    field = rng.choice(["dtype", "shape", "data_offsets", "extra", "rename", "drop"])
    if field == "rename":
        header[name.replace("lora_A", rng.choice(["lora_B", "lora_C", "lora_A.extra"]))] = header.pop(name)
    elif field == "drop":
        del header[name]
    elif field == "extra":
        header[name]["unexpected"] = rng.choice(_ODD_VALUES)
    elif field == "shape" and rng.random() < 0.5:
        header[name]["shape"] = [rng.choice([0, 1, 2, 7, 64, 172, 10**9]) for _ in range(rng.randint(0, 3))]
    elif field == "data_offsets" and rng.random() < 0.5:
        a, b = header[name]["data_offsets"]
        header[name]["data_offsets"] = [a + rng.randint(-8, 8), b + rng.choice([-4, 0, 4, 10**10])]
    else:
        header[name][field] = rng.choice(_ODD_VALUES)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def _mutate_config(config: bytes, rng: random.Random) -> bytes:
    cfg = json.loads(config)
    key = rng.choice(
        [
            "r",
            "lora_alpha",
            "target_modules",
            "rank_pattern",
            "alpha_pattern",
            "use_rslora",
            "peft_type",
            "layers_to_transform",
            "use_dora",
            "modules_to_save",
            "fan_in_fan_out",
            "init_lora_weights",
            "base_model_name_or_path",
            "bias",
        ]
    )
    if rng.random() < 0.15:
        cfg.pop(key, None)
    else:
        cfg[key] = rng.choice(_ODD_VALUES + [{"down_proj": rng.choice(_ODD_VALUES)}])
    return json.dumps(cfg).encode()


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    kind = rng.choice(["truncate", "flip", "length"])
    if kind == "truncate":
        return data[: rng.randint(0, len(data) - 1)]
    if kind == "length":
        return struct.pack("<Q", rng.choice([0, 1, 7, len(data), 2**40, 2**64 - 1])) + data[8:]
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        i = rng.randint(0, min(len(b) - 1, 400))  # mostly the header
        b[i] = rng.randint(0, 255)
    return bytes(b)


def test_mutated_checkpoints_fail_cleanly(valid: tuple[dict, bytes, bytes]) -> None:
    base, config, weights = valid
    rng = random.Random(1234)
    outcomes = {"built": 0, "refused": 0}
    for case in range(CASES):
        c, w = config, weights
        choice = case % 3
        if choice == 0:
            w = _mutate_header(w, rng)
        elif choice == 1:
            c = _mutate_config(c, rng)
        else:
            w = _mutate_bytes(w, rng)
        try:
            ckpt = read_checkpoint(c, w, max_tensors=64)
            adapter = validate(ckpt, base, Limits(max_lora_rank=64))
            optimize(adapter, base, "float16")
            outcomes["built"] += 1
        except StoreError as exc:
            assert str(exc), f"case {case}: empty message"
            outcomes["refused"] += 1
        except Exception as exc:
            pytest.fail(f"case {case} ({['header', 'config', 'bytes'][choice]}): {type(exc).__name__}: {exc}")
    assert outcomes["refused"] > CASES // 2 and outcomes["built"] > 0, outcomes


def _build(base: dict, config: dict, weights: bytes, dtype: str = "float16", validated_for: str = ""):
    ckpt = read_checkpoint(json.dumps(config).encode(), weights, max_tensors=64)
    limits = Limits(max_lora_rank=64, serving_dtype=validated_for or dtype)
    return optimize(validate(ckpt, base, limits), base, dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_scaling_that_overflows_the_serving_dtype_is_refused(
    valid: tuple[dict, bytes, bytes], dtype: str
) -> None:
    base, config, weights = valid
    cfg = json.loads(config)
    assert _build(base, cfg, weights, dtype).digest  # the checkpoint as written builds
    # float32 holds B * 1e30 / r, but no activation holds the update it makes
    with pytest.raises(InvalidArgument, match="input of magnitude 1") as err:
        _build(base, {**cfg, "lora_alpha": 1e30}, weights, dtype)
    assert "lora_B.weight" in str(err.value) and dtype in str(err.value)


def test_a_scaled_b_that_float16_cannot_hold_is_refused_by_optimize(valid: tuple[dict, bytes, bytes]) -> None:
    """optimize's own check, behind validation's: validated for bfloat16 (whose limit lets an update
    of 1e9 pass), the cast of B * 1e10 / r to float16 overflows."""
    base, config, weights = valid
    with pytest.raises(InvalidArgument, match="overflows") as err:
        _build(base, {**json.loads(config), "lora_alpha": 1e10}, weights, "float16", validated_for="bfloat16")
    assert "lora_b" in str(err.value) and "float16" in str(err.value)


@pytest.mark.parametrize("value", ["yes", 1, [], {"q_proj": True}])
def test_use_rslora_must_be_a_boolean(valid: tuple[dict, bytes, bytes], value: object) -> None:
    base, config, weights = valid
    with pytest.raises(InvalidArgument, match="use_rslora must be true or false"):
        _build(base, {**json.loads(config), "use_rslora": value}, weights)
