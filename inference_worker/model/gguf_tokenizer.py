"""The tokenizer of a GGUF file as Hugging Face files: tokenizer.json (a `tokenizers` byte-level
BPE built from the GGUF vocabulary and merges), tokenizer_config.json (special tokens and the chat
template of the GGUF metadata) and generation_config.json (the ids that end generation).

The pre-tokenizer follows llama.cpp's for the file's `tokenizer.ggml.pre`: "gpt2" is GPT-2's
byte-level split, "smollm" splits every digit apart first (as SmolLM's own tokenizer.json does),
"llama-bpe" is Llama 3's split. Control tokens (token type 3) become special added tokens,
user-defined ones (4) plain added tokens, so the rendered chat template tokenizes as llama.cpp and
transformers tokenize it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loraserve.inference_worker.model.config import ModelConfigError
from loraserve.inference_worker.model.gguf_weights import field_value

if TYPE_CHECKING:
    from gguf import GGUFReader
    from tokenizers import Tokenizer
    from tokenizers.pre_tokenizers import PreTokenizer

CONTROL, USER_DEFINED = 3, 4
# Llama 3's split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3), a constant pattern
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_PRE_TOKENIZERS = ("gpt2", "smollm", "llama-bpe")


def _pre_tokenizer(pre: str) -> PreTokenizer:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "gpt2":
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "llama-bpe":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
            ]
        )
    raise ModelConfigError(
        f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
    )


def _token(reader: GGUFReader, key: str, tokens: list[str]) -> str | None:
    tid = field_value(reader, f"tokenizer.ggml.{key}")
    return tokens[int(tid)] if tid is not None and 0 <= int(tid) < len(tokens) else None


def build_tokenizer(reader: GGUFReader) -> Tokenizer:
    """A `tokenizers.Tokenizer` equal to the GGUF file's byte-level BPE tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = field_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelConfigError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE, 'gpt2')")
    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens") or []
    merges: list[str] = field_value(reader, "tokenizer.ggml.merges") or []
    types: list[int] = field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if not tokens or not merges:
        raise ModelConfigError("the GGUF metadata has no tokenizer vocabulary or merges")
    pre = str(field_value(reader, "tokenizer.ggml.pre", "gpt2"))
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=[(a, b) for a, _, b in (m.partition(" ") for m in merges)],
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre == "llama-bpe",  # llama.cpp takes whole-word vocabulary hits for Llama 3
        )
    )
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(
        [
            AddedToken(t, special=types[i] == CONTROL, normalized=False)
            for i, t in enumerate(tokens)
            if types[i] in (CONTROL, USER_DEFINED)
        ]
    )
    bos = _token(reader, "bos_token_id", tokens)
    if field_value(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_id = tokens.index(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(reader: GGUFReader) -> dict:
    """tokenizer_config.json: the special tokens, whether a BOS is added, the chat template."""
    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens") or []
    config: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)),
        "model_max_length": int(field_value(reader, "llama.context_length", 2048)),
    }
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        if (text := _token(reader, key, tokens)) is not None:
            config[name] = text
    template = field_value(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def generation_config(reader: GGUFReader) -> dict:
    """generation_config.json: BOS, and every id that ends generation (EOS and end-of-turn)."""
    eos = [
        int(v)
        for key in ("eos_token_id", "eot_token_id")
        if (v := field_value(reader, f"tokenizer.ggml.{key}")) is not None
    ]
    config: dict = {"eos_token_id": sorted(set(eos)) if len(set(eos)) > 1 else (eos[0] if eos else None)}
    for key in ("bos_token_id", "padding_token_id"):
        if (v := field_value(reader, f"tokenizer.ggml.{key}")) is not None:
            config[key.replace("padding", "pad")] = int(v)
    return {k: v for k, v in config.items() if v is not None}
