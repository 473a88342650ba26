"""Convert a Llama GGUF file into a Hugging Face model directory the worker (and transformers)
loads: config.json, model.safetensors (fp32), tokenizer.json, tokenizer_config.json with the chat
template, generation_config.json.

The directory appears whole or not at all: everything is written into a hidden sibling directory
that is renamed into place last, so an interrupted conversion never leaves a directory that looks
complete (and its leftovers are removed by the next run).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

# on_progress(done, total): tensors converted so far
ProgressCallback = Callable[[int, int], None]
MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


def is_complete(directory: Path) -> bool:
    return all((directory / f).is_file() for f in MODEL_FILES)


def staging_dir(out_dir: Path) -> Path:
    """The hidden sibling a conversion writes into before renaming it to out_dir."""
    return out_dir.parent / f".{out_dir.name}.partial"


def write_hf_model(
    gguf_path: str | Path,
    out_dir: str | Path,
    on_progress: ProgressCallback | None = None,
    extra_files: dict[str, dict] | None = None,
    config_overrides: dict | None = None,
) -> Path:
    """Convert gguf_path into out_dir (which must not exist yet), adding `extra_files` (name ->
    JSON content) and `config_overrides` to config.json; returns out_dir."""
    # imported here: checking a cached directory (is_complete) needs neither torch nor gguf
    from safetensors.torch import save_file

    from loraserve.inference_worker.model.gguf_tokenizer import (
        build_tokenizer,
        generation_config,
        tokenizer_config,
    )
    from loraserve.inference_worker.model.gguf_weights import GGUFLlama

    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    model = GGUFLlama.open(gguf_path)
    stage = staging_dir(out)
    shutil.rmtree(stage, ignore_errors=True)  # leftovers of an interrupted run
    stage.mkdir(parents=True)
    try:
        tensors = {}
        total = model.num_tensors
        for i, (name, tensor) in enumerate(model.tensors(), 1):
            tensors[name] = tensor
            if on_progress is not None:
                on_progress(i, total)
        save_file(tensors, str(stage / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(stage / "model.safetensors", 0o644)  # safetensors writes it owner-only
        del tensors
        build_tokenizer(model.reader).save(str(stage / "tokenizer.json"))
        for name, content in (
            *(extra_files or {}).items(),
            ("tokenizer_config.json", tokenizer_config(model.reader)),
            ("generation_config.json", generation_config(model.reader)),
            ("config.json", {**model.config, **(config_overrides or {})}),
        ):
            (stage / name).write_text(json.dumps(content, indent=2, ensure_ascii=False))
        os.replace(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return out
