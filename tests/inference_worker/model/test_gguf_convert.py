"""A GGUF Llama converted into a Hugging Face directory: every tensor is what the file holds with
llama.cpp's q/k permutation undone, the tokenizer encodes and decodes as the original, the chat
template and stop tokens carry over, and the worker's loader and transformers both load it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from loraserve.inference_worker.model.chat_template import ChatMessage, ChatTemplate
from loraserve.inference_worker.model.config import ModelConfigError
from loraserve.inference_worker.model.gguf_convert import staging_dir, write_hf_model
from loraserve.inference_worker.model.loader import load_model, load_tokenizer
from loraserve.inference_worker.model.tiny import TinyLlamaSpec, write_tiny_llama
from tests.helpers.gguf_files import write_gguf

TEXTS = [
    "Hello world. The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a model 0123456789 = ( ) [ ] { }",
    "unseen wörds ☃ 日本語 and\n\nnewlines\t tabs  ",
    "<|im_start|>user\nHi<|im_end|>\n",
]


@pytest.fixture(scope="module", params=[False, True], ids=["no-bias", "qkv-bias"])
def converted(request, tmp_path_factory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """(original HF dir, converted HF dir, expected tensors)."""
    tmp = tmp_path_factory.mktemp("gguf")
    spec = TinyLlamaSpec(attention_bias=request.param, num_key_value_heads=2, seed=7)
    original = write_tiny_llama(tmp / "original", spec)
    expected = write_gguf(original, tmp / "tiny.gguf")
    return original, write_hf_model(tmp / "tiny.gguf", tmp / "converted"), expected


def test_every_tensor_is_the_files_value_unpermuted(converted) -> None:
    original, out, expected = converted
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == expected.keys()
    raw = load_file(str(original / "model.safetensors"))
    for name, want in expected.items():
        assert got[name].dtype == np.float32 and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)
        # and close to the unquantized original (4-bit blocks: within a few percent of the range)
        span = float(np.abs(raw[name]).max())
        np.testing.assert_allclose(got[name], raw[name], atol=0.15 * span, err_msg=name)


def test_config_and_generation_config(converted) -> None:
    original, out, _ = converted
    cfg, want = (json.loads((d / "config.json").read_text()) for d in (out, original))
    for key in (
        "architectures",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rope_theta",
        "tie_word_embeddings",
        "attention_bias",
        "bos_token_id",
        "eos_token_id",
    ):
        assert cfg[key] == want[key], key
    assert cfg["rms_norm_eps"] == pytest.approx(want["rms_norm_eps"])
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == want["eos_token_id"] and gen["bos_token_id"] == want["bos_token_id"]


def test_tokenizer_round_trip(converted) -> None:
    original, out, _ = converted
    ours, theirs = load_tokenizer(out), load_tokenizer(original)
    assert ours.get_vocab() == theirs.get_vocab()
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    specials = {t.content for t in ours.get_added_tokens_decoder().values() if t.special}
    assert {"<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"} <= specials


def test_chat_template_and_stop_tokens_carry_over(converted) -> None:
    original, out, _ = converted
    ours = ChatTemplate.from_dir(out, load_tokenizer(out))
    theirs = ChatTemplate.from_dir(original, load_tokenizer(original))
    assert ours is not None and theirs is not None
    msgs = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi there")]
    assert ours.render(msgs) == theirs.render(msgs)
    assert ours.end_of_turn_token_ids == theirs.end_of_turn_token_ids


def test_loaders_read_the_converted_directory(converted) -> None:
    transformers = pytest.importorskip("transformers")
    _, out, expected = converted
    model = load_model(out, torch.float32, "cpu")
    torch.testing.assert_close(model.embed_tokens, torch.from_numpy(expected["model.embed_tokens.weight"]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    q = hf.model.layers[1].self_attn.q_proj.weight
    torch.testing.assert_close(q, torch.from_numpy(expected["model.layers.1.self_attn.q_proj.weight"]))
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok(TEXTS[0]).input_ids == load_tokenizer(out).encode(TEXTS[0]).ids


def test_smollm_pre_tokenizer_splits_digits(tmp_path: Path) -> None:
    original = write_tiny_llama(tmp_path / "original")
    write_gguf(original, tmp_path / "smollm.gguf", pre="smollm")
    tok = load_tokenizer(write_hf_model(tmp_path / "smollm.gguf", tmp_path / "out"))
    ids = tok.encode("year 2024 0123456789", add_special_tokens=False).ids
    assert [tok.decode([i]) for i in ids][-14:] == [" ", "2", "0", "2", "4", " ", *"0123456789"][-14:]
    assert tok.decode(ids) == "year 2024 0123456789"


def test_unsupported_file_is_a_clear_error_and_leaves_nothing(tmp_path: Path) -> None:
    original = write_tiny_llama(tmp_path / "original")
    write_gguf(original, tmp_path / "odd.gguf", pre="no-such-pre")
    with pytest.raises(ModelConfigError, match="unsupported GGUF pre-tokenizer 'no-such-pre'"):
        write_hf_model(tmp_path / "odd.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not staging_dir(tmp_path / "out").exists()
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ModelConfigError, match="not a readable GGUF file"):
        write_hf_model(tmp_path / "junk.gguf", tmp_path / "out")


def test_interrupted_conversion_leaves_no_directory(tmp_path: Path) -> None:
    original = write_tiny_llama(tmp_path / "original")
    write_gguf(original, tmp_path / "tiny.gguf")

    def interrupt(done: int, total: int) -> None:
        if done == total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_hf_model(tmp_path / "tiny.gguf", tmp_path / "out", interrupt)
    assert not (tmp_path / "out").exists() and not staging_dir(tmp_path / "out").exists()
    assert (write_hf_model(tmp_path / "tiny.gguf", tmp_path / "out") / "config.json").is_file()
