"""Validation of a PEFT LoRA checkpoint against the base model's config.json.

PEFT saves LoRA weights as `base_model.model.<module path>.lora_A.weight` ([r, in]) and
`.lora_B.weight` ([out, r]); the module path of a Llama-family model is
`model.layers.{L}.self_attn.{q,k,v,o}_proj` or `model.layers.{L}.mlp.{gate,up,down}_proj`.
Per-module rank and alpha: the first `rank_pattern` / `alpha_pattern` key that names the module
wins, else `r` / `lora_alpha` (pattern_keys.py: the keys accepted and how they match; no regular
expression is ever built from checkpoint data).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from loraserve.adapter_store.checkpoint import PeftCheckpoint
from loraserve.adapter_store.errors import FailedPrecondition, InvalidArgument, StoreError
from loraserve.adapter_store.pattern_keys import check_pattern_key, first_matching_key
from loraserve.contract.adapter_layout import MODULES, module_shapes
from loraserve.contract.payload import TORCH_DTYPES

# The layer index as PEFT writes it: ASCII decimal without leading zeros (`\d` would take any
# Unicode digit, and `layers.01` would name the weight of `layers.1` a second time), short enough
# for int().
_TENSOR_RE = re.compile(
    r"base_model\.model\.model\.layers\.(0|[1-9][0-9]{0,8})\.(self_attn|mlp)\.([a-z_]+)\.lora_(A|B)\.weight"
)
_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# LoRA initialisations that rewrite the base weights (PiSSA, OLoRA, LoftQ, CorDA).
_BASE_MUTATING_INITS = ("pissa", "olora", "loftq", "corda")
MAX_PATTERN_KEYS = 1024


@dataclass(frozen=True)
class Limits:
    max_lora_rank: int = 64
    base_model_name: str | None = None  # when set, base_model_name_or_path must agree
    serving_dtype: str = "bfloat16"  # the activations' dtype on the workers (update_bound's limit)


@dataclass
class LoraModule:
    layer: int
    module: str  # one of MODULES
    r: int
    alpha: float
    scale: float  # alpha / r, or alpha / sqrt(r) with rsLoRA
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]


@dataclass
class LoraAdapter:
    """A validated adapter: its modules keyed by (layer, module name)."""

    modules: dict[tuple[int, str], LoraModule]
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model: str = ""

    @property
    def rank(self) -> int:
        return max(m.r for m in self.modules.values())

    @property
    def target_modules(self) -> list[str]:
        present = {m for _, m in self.modules}
        return [m for m in MODULES if m in present]


def module_path(layer: int, module: str) -> str:
    return f"model.layers.{layer}.{_PARENT[module]}.{module}"


def scale_of(alpha: float, r: int, use_rslora: bool) -> float:
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def validate(ckpt: PeftCheckpoint, base_config: dict, limits: Limits) -> LoraAdapter:
    cfg = ckpt.config
    _check_method(cfg)
    r, alpha = _positive_int(cfg.get("r"), "r"), _alpha(cfg.get("lora_alpha"), "lora_alpha")
    use_rslora = cfg.get("use_rslora")
    if use_rslora is None:
        use_rslora = False
    if not isinstance(use_rslora, bool):
        raise InvalidArgument(f"adapter_config.json: use_rslora must be true or false, got {use_rslora!r}")
    rank_pattern = _pattern(cfg.get("rank_pattern"), "rank_pattern", int)
    alpha_pattern = _pattern(cfg.get("alpha_pattern"), "alpha_pattern", float)
    base_model = cfg.get("base_model_name_or_path") or ""
    if not isinstance(base_model, str):
        raise InvalidArgument("adapter_config.json: base_model_name_or_path must be a string")
    if limits.base_model_name is not None and not _same_model(base_model, limits.base_model_name):
        raise FailedPrecondition(
            f"adapter was trained on base model {base_model!r}, but this store serves {limits.base_model_name!r}"
        )
    _check_targets(cfg.get("target_modules"))

    num_layers = int(base_config["num_hidden_layers"])
    shapes = module_shapes(base_config)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in ckpt.tensors.items():
        m = _TENSOR_RE.fullmatch(name)
        if m is None:
            raise _rejection(name)
        layer, parent, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in _PARENT:
            raise FailedPrecondition(
                f"tensor {name!r} targets unsupported module {module!r}; supported: {', '.join(MODULES)}"
            )
        if _PARENT[module] != parent:
            raise InvalidArgument(f"tensor {name!r}: {module} belongs under {_PARENT[module]}, not {parent}")
        if layer >= num_layers:
            raise InvalidArgument(
                f"tensor {name!r} is for layer {layer}, but the base model has {num_layers}"
            )
        found.setdefault((layer, module), {})[which] = t
    if not found:
        raise InvalidArgument("adapter_model.safetensors holds no LoRA tensors")

    keys_r, keys_a = list(rank_pattern), list(alpha_pattern)
    modules: dict[tuple[int, str], LoraModule] = {}
    for (layer, module), pair in sorted(found.items(), key=lambda kv: (kv[0][0], MODULES.index(kv[0][1]))):
        path = module_path(layer, module)
        prefix = f"base_model.model.{path}"
        for which in ("A", "B"):
            if which not in pair:
                raise InvalidArgument(
                    f"tensor {prefix}.lora_{which}.weight is missing (lora_A and lora_B come in pairs)"
                )
        kr, ka = first_matching_key(keys_r, path), first_matching_key(keys_a, path)
        mr = rank_pattern[kr] if kr is not None else r
        ma = alpha_pattern[ka] if ka is not None else alpha
        if mr > limits.max_lora_rank:
            raise InvalidArgument(f"rank {mr} of {path} exceeds max_lora_rank {limits.max_lora_rank}")
        in_f, out_f = shapes[module]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (mr, in_f):
            raise InvalidArgument(
                f"tensor {prefix}.lora_A.weight has shape {list(a.shape)}, "
                f"expected [{mr}, {in_f}] (rank {mr}, in_features {in_f})"
            )
        if tuple(b.shape) != (out_f, mr):
            raise InvalidArgument(
                f"tensor {prefix}.lora_B.weight has shape {list(b.shape)}, "
                f"expected [{out_f}, {mr}] (out_features {out_f}, rank {mr})"
            )
        scale = scale_of(ma, mr, use_rslora)
        _check_update(prefix, a, b, scale, limits.serving_dtype)
        modules[(layer, module)] = LoraModule(layer, module, mr, ma, scale, a, b)
    return LoraAdapter(modules, r, alpha, use_rslora, rank_pattern, alpha_pattern, base_model)


def activation_limit(dtype: str) -> float:
    """The largest activation that stays usable when served in `dtype`: float16's own max; for
    bfloat16 and float32, sqrt(float32 max) ~ 1.8e19, past which the next RMSNorm's square, taken
    in float32, is inf, and the row normalises to zeros (or NaN, where the value itself is inf)."""
    return min(torch.finfo(TORCH_DTYPES[dtype]).max, math.sqrt(torch.finfo(torch.float32).max))


def update_bound(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    """An upper bound of max_i sum_j |(scale * B @ A)[i, j]|, the largest entry of the update for
    an input whose entries are at most 1 in magnitude, without forming B @ A ([out, in], r MACs per
    entry): |sum_k B[i, k] A[k, j]| <= sum_k |B[i, k]| |A[k, j]|, so the row sum is at most
    sum_k |B[i, k]| * ||A[k]||_1. Exact for rank 1 with entries of one sign, at most r times the
    truth otherwise. One pass over A and one over B, elementwise (a [out, r] @ [r] product through
    BLAS was slower on a busy CPU); inf when a sum passes float32's range."""
    a_rows = a.abs().sum(dim=1, dtype=torch.float32)  # [r]; past float32: the shrink's output overflows
    if not bool(torch.isfinite(a_rows).all()):
        return math.inf
    rows = b.abs().to(torch.float32).mul_(a_rows).sum(dim=1)  # [out]; abs made a copy to scale in place
    return float(rows.max()) * scale


def _check_update(prefix: str, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: str) -> None:
    """Finite weights can still make an update no activation holds (1e30 fits bfloat16): the
    adapter's rows would come out as zeros or NaN while the batch's other rows are fine. Refused
    when update_bound passes activation_limit; trained adapters stay orders of magnitude below."""
    limit = activation_limit(dtype)
    bound = update_bound(a, b, scale)
    if not bound <= limit:
        why = (
            "float16's largest value"
            if dtype == "float16"
            else "past which the next RMSNorm's float32 square overflows"
        )
        raise InvalidArgument(
            f"tensors {prefix}.lora_A.weight and {prefix}.lora_B.weight make an update "
            f"({scale:g} * B @ A) of up to {bound:.3g} for an input of magnitude 1, over {limit:.3g} "
            f"({why}; serving dtype {dtype}): weights far outside what training produces"
        )


def _check_method(cfg: dict) -> None:
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise FailedPrecondition(f"peft_type {peft_type!r} is not supported; only LORA adapters are served")
    if cfg.get("use_dora"):
        raise FailedPrecondition("use_dora is set: DoRA adapters are not supported (plain LoRA only)")
    for key in ("modules_to_save", "target_parameters", "layer_replication", "trainable_token_indices"):
        if cfg.get(key):
            raise FailedPrecondition(
                f"{key}={cfg[key]!r} is not supported: only LoRA on {', '.join(MODULES)} can be served"
            )
    if cfg.get("lora_bias"):
        raise FailedPrecondition("lora_bias is set: LoRA bias terms are not supported")
    for key in ("use_qalora", "alora_invocation_tokens", "arrow_config", "fan_in_fan_out"):
        if cfg.get(key):
            raise FailedPrecondition(
                f"{key}={cfg[key]!r}: this LoRA variant is not supported (plain LoRA only)"
            )
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_MUTATING_INITS):
        raise FailedPrecondition(
            f"init_lora_weights={init!r} changes the base model's weights, so the adapter does not apply to "
            "the unmodified base; save it converted to plain LoRA (PEFT save_pretrained with "
            "path_initial_model_for_weight_conversion) and register that"
        )


def _check_targets(targets: object) -> None:
    if isinstance(targets, list):
        bad = [t for t in targets if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in _PARENT]
        if bad:
            raise FailedPrecondition(f"unsupported target module(s) {bad}; supported: {', '.join(MODULES)}")
    elif targets is not None and not isinstance(targets, str):
        raise InvalidArgument("adapter_config.json: target_modules must be a list or a string")


def _rejection(name: str) -> StoreError:
    """The error for a tensor name that is not a LoRA A/B weight of a supported module."""
    if any(
        s in name for s in ("embed_tokens", "lm_head", "modules_to_save", "lora_embedding", "lora_magnitude")
    ):
        return FailedPrecondition(
            f"tensor {name!r} adapts an unsupported module or method; supported: "
            f"LoRA A/B of {', '.join(MODULES)}"
        )
    if ".lora_" in name and "base_model.model.model.layers." in name and not name.endswith(".weight"):
        return FailedPrecondition(f"tensor {name!r} is not supported (LoRA weights only, no bias)")
    return InvalidArgument(f"unexpected tensor {name!r} in adapter_model.safetensors")


def _positive_int(v: object, field_name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise InvalidArgument(f"adapter_config.json: {field_name} must be a positive integer, got {v!r}")
    return v


def _alpha(v: object, field_name: str) -> float:
    """lora_alpha or an alpha_pattern value: a finite number > 0. PEFT itself takes any number
    (scale = alpha / r), but 0 makes the adapter a no-op and a negative alpha negates its update:
    neither is what training produces, so both are refused as a broken config rather than served."""
    try:
        number = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
    except OverflowError:  # an int past the float range
        number = math.inf
    if not math.isfinite(number) or number <= 0:
        raise InvalidArgument(f"adapter_config.json: {field_name} must be a finite number > 0, got {v!r}")
    return number


def _pattern(v: object, field_name: str, kind: type) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict) or len(v) > MAX_PATTERN_KEYS:
        raise InvalidArgument(
            f"adapter_config.json: {field_name} must be an object of at most {MAX_PATTERN_KEYS} keys"
        )
    out: dict = {}
    for key, value in v.items():
        problem = check_pattern_key(key)
        if problem is not None:
            raise InvalidArgument(f"adapter_config.json: {field_name} key {problem}")
        out[key] = (
            _positive_int(value, f"{field_name}[{key!r}]")
            if kind is int
            else _alpha(value, f"{field_name}[{key!r}]")
        )
    return out


def _same_model(declared: str, expected: str) -> bool:
    def tail(s: str) -> str:
        return s.rstrip("/").rsplit("/", 1)[-1]

    return declared == expected or (bool(declared) and tail(declared) == tail(expected))
