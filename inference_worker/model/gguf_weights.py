"""A Llama-architecture GGUF file (llama.cpp's format) read as a Hugging Face checkpoint: the
config.json fields from the GGUF metadata and every tensor under its transformers name, in fp32.

Quantized tensors (Q4_1, Q8_0, K-quants, ...) are dequantized by the `gguf` package's own
quantization code. llama.cpp's converter stores q_proj and k_proj with the rows of each head
permuted (it interleaves the two rotary halves, `permute` in convert_hf_to_gguf.py); this undoes
that permutation, so the tensors are what transformers' LlamaForCausalLM computes with.
Anything this reader does not know (another architecture, an unknown tensor, a quantization type
that `gguf` cannot dequantize) is a `ModelConfigError` naming it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from loraserve.inference_worker.model.config import ModelConfigError

if TYPE_CHECKING:
    from gguf import GGUFReader

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

# GGUF tensor name -> transformers name ({i}: the block index)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def open_gguf(path: str | Path) -> GGUFReader:
    """A `gguf.GGUFReader` over the file (memory-mapped), or a ModelConfigError saying why not."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{path} is not a readable GGUF file: {exc}") from exc


def field_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value (str, number, bool or list of them), or `default` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_name(gguf_name: str) -> str:
    """The transformers tensor name of a GGUF tensor name (raises for an unknown one)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    raise ModelConfigError(f"unexpected tensor {gguf_name!r} in the GGUF file")


def unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation. Per head, llama.cpp stores row (2 * j + half) of
    transformers' row (half * head_dim / 2 + j); w: [num_heads * head_dim, ...] (or a bias)."""
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).copy()


@dataclass(frozen=True)
class GGUFLlama:
    """What a Llama GGUF file holds, in transformers' terms."""

    path: Path
    reader: Any  # gguf.GGUFReader
    config: dict  # config.json

    @classmethod
    def open(cls, path: str | Path) -> GGUFLlama:
        reader = open_gguf(path)
        return cls(Path(path), reader, hf_config(reader))

    @property
    def num_tensors(self) -> int:
        return len(self.reader.tensors)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(transformers name, fp32 tensor) for every tensor of the file, in file order."""
        from gguf.quants import dequantize

        heads = {"q_proj": self.config["num_attention_heads"], "k_proj": self.config["num_key_value_heads"]}
        for t in self.reader.tensors:
            name = hf_name(t.name)
            try:
                values = dequantize(t.data, t.tensor_type)
            except NotImplementedError as exc:
                raise ModelConfigError(
                    f"tensor {t.name!r} has the quantization type {t.tensor_type.name}, which gguf "
                    "cannot dequantize"
                ) from exc
            # GGUF lists dimensions fastest-first; numpy's (and torch's) order is the reverse
            values = values.reshape(tuple(int(d) for d in reversed(t.shape)))
            module = name.rsplit(".", 2)[-2]
            if module in heads:
                values = unpermute_rotary_rows(values, int(heads[module]))
            yield name, torch.from_numpy(np.array(values, dtype=np.float32, order="C", copy=True))


def hf_config(reader: GGUFReader) -> dict:
    """config.json of a LlamaForCausalLM from a Llama GGUF's metadata."""
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelConfigError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )

    def need(key: str) -> Any:
        value = field_value(reader, f"{arch}.{key}")
        if value is None:
            raise ModelConfigError(f"the GGUF metadata lacks {arch}.{key}")
        return value

    names = {t.name for t in reader.tensors}
    hidden, num_heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(field_value(reader, f"{arch}.attention.key_length") or hidden // num_heads)
    if field_value(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ModelConfigError("GGUF rope scaling is not supported")
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    vocab = field_value(reader, f"{arch}.vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ModelConfigError("the GGUF metadata gives no vocabulary size")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "_name_or_path": str(field_value(reader, "general.name", "gguf-llama")),
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(field_value(reader, f"{arch}.attention.head_count_kv") or num_heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(need("context_length")),
        "rope_theta": float(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = field_value(reader, f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[key] = int(value)
    return config
