"""The optimization math computed independently of adapter_store: from the LoRA layers of a
`peft.PeftModel` loaded from the checkpoint (its lora_A / lora_B weights and its own `scaling`),
packed per docs/adapter-layout.md with plain torch."""

from __future__ import annotations

from pathlib import Path

import torch

GROUPS = {
    "qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o": ("self_attn", ("o_proj",)),
    "gate_up": ("mlp", ("gate_proj", "up_proj")),
    "down": ("mlp", ("down_proj",)),
}


def expected_tensors(base_dir: Path, adapter_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    out: dict[str, torch.Tensor] = {}
    for li, layer in enumerate(model.base_model.model.model.layers):
        for group, (parent, names) in GROUPS.items():
            mods = [getattr(getattr(layer, parent), n) for n in names]
            lora = [m if hasattr(m, "lora_A") and "default" in m.lora_A else None for m in mods]
            if not any(lora):
                continue
            r_g = max(m.r["default"] for m in lora if m is not None)
            a_parts, b_parts = [], []
            for m, base_mod in zip(lora, mods, strict=True):
                in_f = base_mod.in_features
                out_f = base_mod.out_features
                a = torch.zeros(r_g, in_f)
                b = torch.zeros(out_f, r_g)
                if m is not None:
                    r = m.r["default"]
                    a[:r] = m.lora_A["default"].weight.detach().float()
                    b[:, :r] = m.lora_B["default"].weight.detach().float() * m.scaling["default"]
                a_parts.append(a)
                b_parts.append(b)
            out[f"layers.{li}.{group}.lora_a"] = torch.stack(a_parts).to(dtype)
            out[f"layers.{li}.{group}.lora_b"] = torch.cat(b_parts).to(dtype)
    return out
