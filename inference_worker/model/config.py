"""The subset of a Hugging Face `config.json` that the Llama-family decoder needs, checked at load."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from loraserve.inference_worker.errors import WorkerError

# architectures -> whether q/k/v carry a bias regardless of `attention_bias`
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}


class ModelConfigError(WorkerError, ValueError):
    """The checkpoint directory is missing a file or describes a model this worker cannot run."""

    code = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # "default", "linear" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: RopeScaling
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]
    raw: dict
    sliding_window: int | None = None  # attention window when the model uses one (then a length cap)

    @classmethod
    def from_dict(cls, cfg: dict, name: str = "model") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (only silu)")
        if cfg.get("mlp_bias"):
            raise ModelConfigError("mlp_bias=true is not supported")
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelConfigError("partial_rotary_factor != 1 is not supported")
        try:
            hidden = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
            rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
            theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
            return cls(
                name=str(cfg.get("_name_or_path") or name),
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rope_theta=theta,
                rope_scaling=_rope_scaling(rope),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=SUPPORTED_ARCHITECTURES[arch] or bool(cfg.get("attention_bias", False)),
                eos_token_ids=eos_ids,
                raw=cfg,
                sliding_window=_sliding_window(arch, cfg),
            )
        except KeyError as exc:
            raise ModelConfigError(f"config.json lacks the field {exc.args[0]!r}") from exc

    @classmethod
    def from_dir(cls, directory: str | Path) -> ModelConfig:
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"no config.json in model directory {directory}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"config.json is not valid JSON: {exc}") from exc
        return cls.from_dict(cfg, name=Path(directory).resolve().name)


def _sliding_window(arch: str, cfg: dict) -> int | None:
    window = cfg.get("sliding_window")
    if not window or (arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False)):
        return None
    return int(window)


def _rope_scaling(rope: dict) -> RopeScaling:
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "default":
        return RopeScaling("default")
    if rope_type == "linear":
        return RopeScaling("linear", factor=float(rope["factor"]))
    if rope_type == "llama3":
        return RopeScaling(
            "llama3",
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    raise ModelConfigError(f"unsupported rope_scaling type {rope_type!r} (default, linear, llama3)")


def rope_inv_freq(cfg: ModelConfig) -> list[float]:
    """Inverse frequencies [head_dim / 2] of rotary embeddings, with Llama 3 frequency scaling:
    wavelengths above original_len / low_freq_factor are divided by `factor`, below
    original_len / high_freq_factor kept, and interpolated smoothly in between."""
    d = cfg.head_dim
    inv = [1.0 / (cfg.rope_theta ** (i / d)) for i in range(0, d, 2)]
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        return [f / rs.factor for f in inv]
    if rs.rope_type != "llama3":
        return inv
    old = rs.original_max_position_embeddings
    low_wavelen, high_wavelen = old / rs.low_freq_factor, old / rs.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / rs.factor)
        else:
            smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
            out.append((1 - smooth) * f / rs.factor + smooth * f)
    return out
