"""Tiny random Llama-shaped checkpoints in Hugging Face layout, made locally (no download).

Used by the embedded default (`loraserve up`), the tests and the benchmarks. The output is a
directory `transformers.LlamaForCausalLM.from_pretrained` can read: config.json,
model.safetensors, tokenizer.json (a byte-level BPE trained here on a built-in text, plus ChatML's
turn tokens), tokenizer_config.json with a ChatML chat template like SmolLM2's, and
generation_config.json (generation stops at </s> and <|im_end|>).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_CORPUS = """\
loraserve serves many low-rank adapters of one base model from a fleet of workers.
The adapter store fetches checkpoints, validates them and streams them to the workers.
Each worker keeps the most recently used adapters in GPU slots and the rest in a CPU cache.
Every request in a batch may use its own adapter; the kernels apply them all at once.
Hello world. The quick brown fox jumps over the lazy dog. Once upon a time there was a model
that learned to speak in many voices, one for each adapter it was given.
0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' " @ # $ % & _ ~
"""

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# ChatML, as SmolLM2-Instruct writes it (with a shorter default system prompt)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyLlamaSpec:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 172  # deliberately not a multiple of 16
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    init_std: float = 0.08
    seed: int = 0
    name: str = "tiny-llama"


def build_tokenizer(vocab_size: int) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.add_special_tokens([IM_START, IM_END])  # after training: the trained ids stay as they were
    return tok


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """A tokenizer for random-weight models of any vocabulary size (benchmarks): token i is the word
    `w{i}`, decoded space-separated, so detokenization runs the real incremental path at a
    realistic cost."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return tok


def llama_config(spec: TinyLlamaSpec, vocab_size: int, bos_id: int, eos_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "_name_or_path": spec.name,
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.attention_bias,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def random_llama_weights(spec: TinyLlamaSpec, vocab_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * spec.init_std).contiguous()

    h, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    nh, nkv = spec.num_attention_heads, spec.num_key_value_heads
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(vocab_size, h)}
    for layer in range(spec.num_hidden_layers):
        p = f"model.layers.{layer}."
        w[p + "self_attn.q_proj.weight"] = rnd(nh * d, h)
        w[p + "self_attn.k_proj.weight"] = rnd(nkv * d, h)
        w[p + "self_attn.v_proj.weight"] = rnd(nkv * d, h)
        w[p + "self_attn.o_proj.weight"] = rnd(h, nh * d)
        if spec.attention_bias:
            w[p + "self_attn.q_proj.bias"] = rnd(nh * d)
            w[p + "self_attn.k_proj.bias"] = rnd(nkv * d)
            w[p + "self_attn.v_proj.bias"] = rnd(nkv * d)
        w[p + "mlp.gate_proj.weight"] = rnd(i, h)
        w[p + "mlp.up_proj.weight"] = rnd(i, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, i)
        w[p + "input_layernorm.weight"] = 1.0 + rnd(h)
        w[p + "post_attention_layernorm.weight"] = 1.0 + rnd(h)
    w["model.norm.weight"] = 1.0 + rnd(h)
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = rnd(vocab_size, h)
    return w


def write_tiny_llama(directory: str | Path, spec: TinyLlamaSpec | None = None) -> Path:
    """Write a tiny random Llama checkpoint; returns the directory. Deterministic in `spec`."""
    spec = spec or TinyLlamaSpec()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(spec.vocab_size)
    vocab_size = tok.get_vocab_size()
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    assert bos_id is not None and eos_id is not None  # the trainer's special tokens
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": BOS,
                "eos_token": EOS,
                "pad_token": PAD,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos_id, "eos_token_id": [eos_id, tok.token_to_id(IM_END)]}, indent=2)
    )
    (out / "config.json").write_text(json.dumps(llama_config(spec, vocab_size, bos_id, eos_id), indent=2))
    save_file(
        random_llama_weights(spec, vocab_size), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    (out / "loraserve-spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return out
