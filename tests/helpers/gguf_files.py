"""Tiny GGUF files written with the `gguf` package's writer, as llama.cpp's converter writes a Llama:
q/k rows permuted per head, matrices quantized (Q8_0 embeddings, Q4_1 attention and gate/up, F16
where a row is not a whole number of quantization blocks), norms and biases in F32, the byte-level
BPE vocabulary, merges and token types, the chat template."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

# transformers suffix -> GGUF suffix of a block's tensors
BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf: str) -> str:
    if hf in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{BLOCK_NAMES[rest]}"


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: the two rotary halves of each head interleaved."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quant_type(hf: str, w: np.ndarray) -> gguf.GGMLQuantizationType:
    Q = gguf.GGMLQuantizationType
    if w.ndim == 1:
        return Q.F32
    block = gguf.GGML_QUANT_SIZES[Q.Q4_1][0]
    if w.shape[-1] % block:
        return Q.F16
    return Q.Q8_0 if "embed" in hf else Q.Q4_1


def stored_values(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """What the GGUF file holds of w, dequantized (exact for F32)."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return w
    if qtype == gguf.GGMLQuantizationType.F16:
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)


def write_gguf(hf_dir: Path, out: Path, pre: str = "gpt2") -> dict[str, np.ndarray]:
    """A GGUF file of the HF checkpoint at hf_dir; returns, per transformers name, the values that
    a correct reader must give back (quantization rounding included, permutation undone)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    for t in tok["added_tokens"]:
        vocab[t["content"]] = t["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(cfg["_name_or_path"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tok_cfg["bos_token"]])
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    w.add_pad_token_id(vocab[tok_cfg["pad_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_cfg["chat_template"])

    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    expected = {}
    for name, value in load_file(str(hf_dir / "model.safetensors")).items():
        value = value.astype(np.float32)
        qtype = quant_type(name, value)
        # quantization blocks run along rows, so quantizing commutes with permuting rows
        expected[name] = stored_values(value, qtype)
        module = name.rsplit(".", 2)[-2]
        data = llama_cpp_permute(value, heads[module]) if module in heads else value
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), data)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name(name), data.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected
