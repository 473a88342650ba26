"""The optimized adapter layout: the contract between the store (which writes it once) and the
worker (which copies it into GPU slots with no transform). See docs/adapter-layout.md.

Layout version 1. Per decoder layer, per module group that the adapter targets in that layer:

    layers.{L}.{group}.lora_a : [num_slices, r_g, in_features]   (PEFT lora_A.weight per slice)
    layers.{L}.{group}.lora_b : [out_total, r_g]                  (PEFT lora_B.weight * scale,
                                                                   slices concatenated on rows)

- groups and slices: qkv = q|k|v, o, gate_up = gate|up, down (GROUPS below);
- r_g = max rank over the group's targeted slices; a slice of lower rank is zero-padded to r_g
  (zero rows of A, zero columns of B), an untargeted slice of the group is all zeros;
- scale = lora_alpha / r (or lora_alpha / sqrt(r) with use_rslora), per module, honouring PEFT's
  rank_pattern / alpha_pattern; folded into B before the cast to the serving dtype;
- tensors in order of layer, then group (GROUPS order), lora_a before lora_b, each starting at a
  multiple of ALIGN bytes in the payload (zero padding between, covered by the digest);
- digest = sha256 over the whole payload.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LAYOUT_VERSION = 1
# Adapter ids, as both services accept them (DESIGN.md, step 1); always checked with fullmatch
# (`$` would also match before a trailing newline).
ADAPTER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
DIGEST_RE = re.compile(r"[0-9a-f]{64}")  # a payload's sha256, as manifests and hand-over files name it
ALIGN = 64  # bytes
CHUNK_SIZE = 1 << 20  # FetchAdapter data chunks carry at most 1 MiB

# Canonical module order; also the order of AdapterInfo.target_modules.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModuleGroup:
    name: str
    slices: tuple[str, ...]  # PEFT module names, in packing order


GROUPS = (
    ModuleGroup("qkv", ("q_proj", "k_proj", "v_proj")),
    ModuleGroup("o", ("o_proj",)),
    ModuleGroup("gate_up", ("gate_proj", "up_proj")),
    ModuleGroup("down", ("down_proj",)),
)
GROUP_OF_MODULE = {m: g for g in GROUPS for m in g.slices}

DTYPES = ("bfloat16", "float16", "float32")
ITEMSIZES = {"bfloat16": 2, "float16": 2, "float32": 4}  # bytes per element of each of DTYPES


def tensor_name(layer: int, group: str, which: str) -> str:
    """which is "lora_a" or "lora_b"."""
    return f"layers.{layer}.{group}.{which}"


def module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module for an HF Llama-family config.json."""
    h = int(config["hidden_size"])
    i = int(config["intermediate_size"])
    nh = int(config["num_attention_heads"])
    nkv = int(config.get("num_key_value_heads") or nh)
    d = int(config.get("head_dim") or h // nh)
    return {
        "q_proj": (h, nh * d),
        "k_proj": (h, nkv * d),
        "v_proj": (h, nkv * d),
        "o_proj": (nh * d, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def group_dims(config: dict, group: ModuleGroup) -> tuple[int, list[int]]:
    """(in_features, [out_features of each slice]) of a module group."""
    shapes = module_shapes(config)
    return shapes[group.slices[0]][0], [shapes[m][1] for m in group.slices]


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
