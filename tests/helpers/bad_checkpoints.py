"""Writers of broken checkpoints for the bad-input matrix: each starts from a good adapter
directory and damages one thing."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def copy_adapter(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(d: Path, **changes: object) -> Path:
    cfg = json.loads((d / CONFIG).read_text())
    cfg.update(changes)
    (d / CONFIG).write_text(json.dumps(cfg))
    return d


def edit_tensors(d: Path, fn) -> Path:
    tensors = load_file(str(d / WEIGHTS))
    fn(tensors)
    save_file(tensors, str(d / WEIGHTS), metadata={"format": "pt"})
    return d


def first_name(d: Path, suffix: str) -> str:
    return sorted(n for n in load_file(str(d / WEIGHTS)) if n.endswith(suffix))[0]


def write_raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def raw_header(d: Path) -> tuple[dict, bytes]:
    blob = (d / WEIGHTS).read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def set_nan(d: Path, value: float) -> str:
    name = first_name(d, "lora_B.weight")

    def fn(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].clone()
        t[name][0, 0] = value

    edit_tensors(d, fn)
    return name
