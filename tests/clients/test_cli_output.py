"""The client commands speak one dialect: `--json` on every command that lists or shows, the same
TLS flags everywhere, and the exit statuses docs/operations.md lists."""

from __future__ import annotations

import json

import pytest

from loraserve.cli import main as cli_main
from tests.helpers.ports import free_port
from tests.helpers.workers import worker_config

CLIENT_COMMANDS = ("register", "adapters", "generate", "slots", "bench", "health")


@pytest.mark.parametrize("command", CLIENT_COMMANDS)
def test_one_naming_of_the_tls_flags(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        cli_main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "--tls " in text and "--tls-ca PEM" in text, text
    assert "--ca-cert" not in text and "--cacert" not in text


def test_json_from_every_listing_and_showing_command(start_store, tiny_model_dir, capsys) -> None:
    from loraserve.inference_worker.server import BackgroundWorker

    store = start_store()
    at_store = ["--store", store.address]
    assert cli_main(["register", "qv", "peft-qv-r8", *at_store, "--json"]) == 0
    registered = json.loads(capsys.readouterr().out)
    assert registered["adapter_id"] == "qv" and registered["rank"] == 8
    assert cli_main(["adapters", "list", *at_store, "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["digest"] == registered["digest"]
    assert cli_main(["adapters", "show", "qv", *at_store, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["adapter_id"] == "qv"

    worker = BackgroundWorker(worker_config(tiny_model_dir, store_address=store.address))
    try:
        at_worker = ["--worker", worker.address]
        assert cli_main(["slots", "load", "qv", *at_worker, "--json"]) == 0
        (loaded,) = json.loads(capsys.readouterr().out)
        assert loaded["adapter_id"] == "qv" and loaded["tier"] == "gpu" and loaded["slot"] >= 0
        assert cli_main(["slots", "list", *at_worker, "--json"]) == 0
        assert [a["adapter_id"] for a in json.loads(capsys.readouterr().out)] == ["qv"]
        argv = ["generate", "hello", "--adapter", "qv"]
        assert cli_main([*argv, "--max-tokens", "3", "--ignore-eos", *at_worker, "--json"]) == 0
        generation = json.loads(capsys.readouterr().out)
        assert len(generation["completions"][0]["token_ids"]) == 3
        assert generation["usage"]["completion_tokens"] == 3
        assert cli_main(["health", worker.address, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["status"] == "SERVING"
        assert cli_main(["slots", "unload", "qv", *at_worker, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == {"adapter_id": "qv", "unloaded": True}
    finally:
        worker.stop()


def test_exit_statuses(start_store, capsys) -> None:
    store = start_store()
    assert cli_main(["adapters", "show", "missing", "--store", store.address]) == 1  # an error status
    assert "NOT_FOUND" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        cli_main(["adapters", "--no-such-flag"])
    assert usage.value.code == 2
    assert cli_main(["no-such-command"]) == 2
    assert cli_main(["health", f"127.0.0.1:{free_port()}", "--timeout", "0.5"]) == 3  # no answer


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--max-tokens", "0"], "--max-tokens: need a whole number >= 1, got 0"),
        (["--max-tokens", "-5"], "--max-tokens: need a whole number >= 1, got -5"),
        (["--max-tokens", "many"], "--max-tokens: expected a whole number, got 'many'"),
        (["-n", "0"], "-n: need a whole number >= 1, got 0"),
        (["-n", "-1"], "-n: need a whole number >= 1, got -1"),
        (["--top-logprobs", "-1"], "--top-logprobs: need a whole number >= 0, got -1"),
    ],
)
def test_generate_counts_below_one_are_usage_errors(argv, words, capsys) -> None:
    """0 is no "default": a usage error before any worker is called (none listens there)."""
    with pytest.raises(SystemExit) as usage:
        cli_main(["generate", "hello", "--worker", f"127.0.0.1:{free_port()}", *argv])
    assert usage.value.code == 2
    assert words in capsys.readouterr().err


def test_progress_only_on_a_terminal(monkeypatch, capsys) -> None:
    import sys

    from loraserve.clients.cli_options import progress, progress_bar

    with progress_bar("loading") as on_progress:  # pytest's stderr is no terminal
        assert on_progress is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    with progress_bar("loading") as on_progress:
        assert on_progress is not None
        on_progress(3, 4)
    with progress("registering x"):
        pass
    assert "loading" in capsys.readouterr().err
