"""Our own generator of PEFT-format LoRA adapters (no peft import, no download).

Writes what `peft`'s `save_pretrained(safe_serialization=True)` writes for a Llama-family model:
adapter_config.json and adapter_model.safetensors with tensors named
`base_model.model.model.layers.{L}.{self_attn|mlp}.{module}.lora_{A|B}.weight`, A [r, in] and
B [out, r], for any base config.json. Used by `loraserve up`, the tests and the benchmarks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraserve.adapter_store.pattern_keys import first_matching_key
from loraserve.adapter_store.validate import module_path
from loraserve.contract.adapter_layout import MODULES, module_shapes


@dataclass(frozen=True)
class DemoAdapterSpec:
    name: str
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    layers: tuple[int, ...] | None = None  # PEFT layers_to_transform; None = every layer
    seed: int = 0


# The embedded default's adapters: different ranks, module subsets, rsLoRA and a rank_pattern.
DEMO_ADAPTERS = (
    DemoAdapterSpec("demo-qv-r8", r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"), seed=1),
    DemoAdapterSpec("demo-all-r16", r=16, lora_alpha=16, target_modules=MODULES, use_rslora=True, seed=2),
    DemoAdapterSpec(
        "demo-mlp-r4",
        r=4,
        lora_alpha=8,
        target_modules=("gate_proj", "up_proj", "down_proj"),
        rank_pattern={"down_proj": 2},
        seed=3,
    ),
)


def write_peft_adapter(
    out_dir: str | Path,
    base_config: dict,
    spec: DemoAdapterSpec,
    *,
    dtype: torch.dtype = torch.float32,
    base_model_name: str = "",
    b_std: float = 0.05,
) -> Path:
    """Write one adapter with random non-zero A and B (PEFT's B starts at zero: a no-op adapter)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shapes = module_shapes(base_config)
    layers = spec.layers if spec.layers is not None else range(int(base_config["num_hidden_layers"]))
    g = torch.Generator().manual_seed(spec.seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in layers:
        for module in MODULES:
            if module not in spec.target_modules:
                continue
            path = module_path(layer, module)
            key = first_matching_key(list(spec.rank_pattern), path)
            r = spec.rank_pattern[key] if key is not None else spec.r
            in_f, out_f = shapes[module]
            a = torch.randn(r, in_f, generator=g) / math.sqrt(in_f)  # [r, in]
            b = torch.randn(out_f, r, generator=g) * b_std  # [out, r]
            tensors[f"base_model.model.{path}.lora_A.weight"] = a.to(dtype)
            tensors[f"base_model.model.{path}.lora_B.weight"] = b.to(dtype)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": spec.r,
        "lora_alpha": spec.lora_alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(spec.target_modules),
        "use_rslora": spec.use_rslora,
        "use_dora": False,
        "rank_pattern": dict(spec.rank_pattern),
        "alpha_pattern": dict(spec.alpha_pattern),
        "layers_to_transform": list(spec.layers) if spec.layers is not None else None,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def write_demo_adapters(
    root: str | Path, base_dir: str | Path, specs: tuple[DemoAdapterSpec, ...] = DEMO_ADAPTERS
) -> dict[str, Path]:
    """Write each demo adapter under root/<name> unless it is already there; name -> directory."""
    base_dir = Path(base_dir)
    base_config = json.loads((base_dir / "config.json").read_text())
    name = base_config.get("_name_or_path") or base_dir.name
    out: dict[str, Path] = {}
    for spec in specs:
        d = Path(root) / spec.name
        if not (d / "adapter_model.safetensors").exists() or not (d / "adapter_config.json").exists():
            write_peft_adapter(d, base_config, spec, base_model_name=name)
        out[spec.name] = d
    return out
