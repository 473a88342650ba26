"""The decoder computes the same function as `transformers` for the same checkpoint (fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraserve.inference_worker.engine.engine import EngineConfig, LLMEngine
from loraserve.inference_worker.engine.model_runner import ModelRunner
from loraserve.inference_worker.engine.scheduler import ScheduledBatch
from loraserve.inference_worker.engine.sequence import SamplingParams, Sequence
from loraserve.inference_worker.engine.text_stream import TextStream
from loraserve.inference_worker.model.config import ModelConfigError
from loraserve.inference_worker.model.loader import load_model, load_tokenizer
from loraserve.inference_worker.model.tiny import TinyLlamaSpec, write_tiny_llama
from tests.helpers.engine_run import generate

transformers = pytest.importorskip("transformers")

PROMPT = "Hello world. The quick brown fox jumps over the lazy dog. Once upon a time"


def our_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """Logits of every prompt position: [len(ids), vocab]."""
    model = load_model(model_dir, torch.float32, "cpu")
    runner = ModelRunner(
        model, num_blocks=32, block_size=16, max_num_seqs=1, max_model_len=512, use_cuda_graphs=False
    )
    seq = Sequence("r", ids, SamplingParams(), lambda _: None, TextStream(None))
    seq.block_table = list(range(1, 1 + (len(ids) + 15) // 16))
    batch, _ = runner.build_batch(ScheduledBatch(prefills=[(seq, len(ids))]), pad_to=None)
    with torch.inference_mode():
        return model.compute_logits(model(batch))


def hf_model(model_dir: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def check_parity(model_dir: Path, max_new_tokens: int = 24) -> None:
    tok = load_tokenizer(model_dir)
    ids = tok.encode(PROMPT).ids
    hf = hf_model(model_dir)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = our_logits(model_dir, ids)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    # greedy decoding through the engine, the prompt prefilled in chunks of 8 tokens
    with torch.inference_mode():
        want = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    engine = LLMEngine(
        load_model(model_dir, torch.float32, "cpu"),
        tok,
        EngineConfig(max_num_batched_tokens=8, num_blocks=32, use_cuda_graphs=False),
    )
    got = generate(engine, ids, SamplingParams(max_tokens=max_new_tokens, ignore_eos=True))
    assert got == want


def test_llama_parity(tiny_model_dir: Path) -> None:
    check_parity(tiny_model_dir)


def _rewrite_config(model_dir: Path, **changes) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        del cfg[k]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    return cfg


def test_tied_bias_llama3_rope_sharded_parity(tmp_path: Path) -> None:
    spec = TinyLlamaSpec(tie_word_embeddings=True, attention_bias=True, seed=3, max_position_embeddings=4096)
    d = write_tiny_llama(tmp_path / "variant", spec)
    _rewrite_config(
        d,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    # shard the checkpoint in two files with an index, as save_pretrained does for large models
    weights = load_file(str(d / "model.safetensors"))
    names = sorted(weights)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for fname, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(d / fname), metadata={"format": "pt"})
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}})
    )
    check_parity(d)


def test_qwen2_parity(tmp_path: Path) -> None:
    d = write_tiny_llama(tmp_path / "qwen2", TinyLlamaSpec(attention_bias=True, seed=5, rope_theta=1e6))
    _rewrite_config(
        d,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        attention_bias=None,
        mlp_bias=None,
        head_dim=None,
        use_sliding_window=False,
    )
    check_parity(d)


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    d = write_tiny_llama(tmp_path / "gpt", TinyLlamaSpec())
    _rewrite_config(d, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ModelConfigError, match="unsupported architecture"):
        load_model(d, torch.float32, "cpu")


def test_missing_files_are_named(tmp_path: Path) -> None:
    d = write_tiny_llama(tmp_path / "m", TinyLlamaSpec())
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelConfigError, match="tokenizer.json"):
        load_tokenizer(d)
    weights = load_file(str(d / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(ModelConfigError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(d, torch.float32, "cpu")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelConfigError, match="no model.safetensors"):
        load_model(d, torch.float32, "cpu")
    with pytest.raises(ModelConfigError, match="does not exist"):
        load_model(tmp_path / "nowhere", torch.float32, "cpu")


def test_unsupported_rope_scaling(tmp_path: Path) -> None:
    d = write_tiny_llama(tmp_path / "yarn", TinyLlamaSpec())
    _rewrite_config(d, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelConfigError, match="yarn"):
        load_model(d, torch.float32, "cpu")
