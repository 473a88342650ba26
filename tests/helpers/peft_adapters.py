"""PEFT checkpoints made by the real `peft` library on the tiny base model (the test oracle)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_peft_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    r: int = 8,
    lora_alpha: float = 16.0,
    target_modules: tuple[str, ...] = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    layers_to_transform: list[int] | None = None,
    seed: int = 0,
    b_std: float = 0.05,
) -> Path:
    """Wrap the base model with `peft.get_peft_model`, give every lora_B a non-zero random value
    (PEFT initialises B to zero, which would make the adapter a no-op) and save it with
    `save_pretrained` (adapter_config.json + adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    cfg = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        layers_to_transform=layers_to_transform,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (b_std if "lora_B" in name else 0.2))
    out = Path(out_dir)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def peft_reference(base_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], max_new_tokens: int):
    """(greedy tokens up to EOS, raw logits of the first generated position [V]) from
    transformers + peft."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    eos = model.config.eos_token_id
    if eos in tokens:
        tokens = tokens[: tokens.index(eos)]
    return tokens, out.logits[0][0].float()
