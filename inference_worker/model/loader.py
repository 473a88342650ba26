"""Load a Hugging Face checkpoint directory into `LlamaModel`, fusing q|k|v and gate|up at load.

Reads config.json, model.safetensors or the shards named by model.safetensors.index.json, and
tokenizer.json (through `tokenizers`). Under tensor parallelism each rank reads only its slice of
each tensor (`safe_open(...).get_slice`, parallel/shard.py says which). Every missing file, unknown or missing tensor and shape
mismatch is a `ModelConfigError` naming it, raised at start-up.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from loraserve.contract.adapter_layout import GROUPS
from loraserve.inference_worker.model.config import ModelConfig, ModelConfigError
from loraserve.inference_worker.model.linear import GroupedLinear
from loraserve.inference_worker.model.llama import LlamaModel

if TYPE_CHECKING:
    from loraserve.inference_worker.parallel.group import TensorParallelGroup

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# the decoder-layer module holding each adapter-layout group
_GROUP_PARENT = {"qkv": "self_attn", "o": "self_attn", "gate_up": "mlp", "down": "mlp"}
# HF suffix -> (our parameter path inside the layer, slice index within the fused group)
_LAYER_PARAMS = {
    f"{_GROUP_PARENT[g.name]}.{module}": (f"{_GROUP_PARENT[g.name]}.{g.name}", i)
    for g in GROUPS
    for i, module in enumerate(g.slices)
}


def checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({directory / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelConfigError(f"shards named in {index.name} are missing: {', '.join(missing)}")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    if list(directory.glob("*.bin")) or list(directory.glob("*.pt")):
        raise ModelConfigError(f"{directory} holds only pickle weights; convert them to safetensors")
    raise ModelConfigError(f"no model.safetensors or model.safetensors.index.json in {directory}")


def _target(model: LlamaModel, name: str) -> tuple[torch.Tensor, int, int]:
    """HF tensor name -> (destination parameter, row offset, row count) or raises."""
    cfg = model.config
    # the vocabulary rows the checkpoint holds for this process (a shard's padding rows stay zero)
    vocab = min(model.dims.vocab_rows, cfg.vocab_size - model.vocab_start)
    if name == "model.embed_tokens.weight":
        return model.embed_tokens, 0, vocab
    if name == "lm_head.weight" and not cfg.tie_word_embeddings:
        return model.lm_head, 0, vocab
    if name == "model.norm.weight":
        return model.norm.weight, 0, cfg.hidden_size
    m = _LAYER.fullmatch(name)
    if m and int(m.group(1)) < cfg.num_layers:
        layer = model.layers[int(m.group(1))]
        rest = m.group(2)
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return layer.get_parameter(rest), 0, cfg.hidden_size
        module_name, _, kind = rest.rpartition(".")
        if module_name in _LAYER_PARAMS and kind in ("weight", "bias"):
            path, idx = _LAYER_PARAMS[module_name]
            mod = layer.get_submodule(path)
            assert isinstance(mod, GroupedLinear)
            param = getattr(mod, kind)
            if param is not None:
                return param, sum(mod.out_sizes[:idx]), mod.out_sizes[idx]
    raise ModelConfigError(f"unexpected tensor {name!r} in the checkpoint")


@torch.no_grad()
def load_model(
    directory: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    on_progress: Callable[[int, int], None] | None = None,
    tp: TensorParallelGroup | None = None,
) -> LlamaModel:
    """`on_progress(tensors loaded, tensors expected)` is called after each tensor (a progress bar).
    With `tp`, the rank's shard (model/sharded_llama.py)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelConfigError(f"model directory {directory} does not exist")
    cfg = ModelConfig.from_dir(directory)
    files = checkpoint_files(directory)
    if tp is None:
        model = LlamaModel(cfg, dtype, device)
    else:
        from loraserve.inference_worker.model.sharded_llama import ShardedLlamaModel

        model = ShardedLlamaModel(cfg, dtype, device, tp)
    names = {(id(p), off): n for n, p, off in _named_targets(model)}
    seen: set[tuple[int, int]] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq") or (
                    name == "lm_head.weight" and cfg.tie_word_embeddings
                ):
                    continue
                param, off, rows = _target(model, name)
                tensor = f.get_tensor(name) if tp is None else _read_shard(f, name, cfg, tp)
                want = (rows, *param.shape[1:])
                if tuple(tensor.shape) != want:
                    raise ModelConfigError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {want}"
                    )
                param[off : off + rows].copy_(tensor.to(dtype))
                seen.add((id(param), off))
                if on_progress is not None:
                    on_progress(len(seen), len(names))
    missing = names.keys() - seen
    if missing:
        raise ModelConfigError(f"checkpoint lacks tensors: {', '.join(sorted(names[m] for m in missing))}")
    return model


def _read_shard(f: Any, name: str, cfg: ModelConfig, tp: TensorParallelGroup) -> torch.Tensor:
    """The rank's slice of a checkpoint tensor, read without the rest of it."""
    where = tp.shard.checkpoint_slice(cfg, name)
    if where is None:
        return f.get_tensor(name)
    dim, (start, count) = where
    part = f.get_slice(name)
    return part[start : start + count] if dim == 0 else part[:, start : start + count]


def _named_targets(model: LlamaModel) -> list[tuple[str, torch.Tensor, int]]:
    cfg = model.config
    out: list[tuple[str, torch.Tensor, int]] = [
        ("model.embed_tokens.weight", model.embed_tokens, 0),
        ("model.norm.weight", model.norm.weight, 0),
    ]
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", model.lm_head, 0))
    for i in range(cfg.num_layers):
        for hf, _ in _LAYER_PARAMS.items():
            kinds = ["weight"] + (
                ["bias"] if cfg.qkv_bias and hf.split(".")[-1] in ("q_proj", "k_proj", "v_proj") else []
            )
            for kind in kinds:
                name = f"model.layers.{i}.{hf}.{kind}"
                p, off, _ = _target(model, name)
                out.append((name, p, off))
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            name = f"model.layers.{i}.{norm}"
            out.append((name, model.layers[i].get_parameter(norm), 0))
    return out


def load_tokenizer(directory: str | Path) -> Tokenizer:
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise ModelConfigError(f"no tokenizer.json in model directory {directory}")
    return Tokenizer.from_file(str(path))
