"""`loraserve health` (the container health check) against a real store: serving, draining, an unknown
service name, and a port where nothing listens."""

from __future__ import annotations

import time

from loraserve.cli import main as cli_main
from tests.helpers.ports import free_port


def test_health_follows_the_store(start_store, capsys) -> None:
    store = start_store()
    assert cli_main(["health", store.address]) == 0
    assert cli_main(["health", store.address, "--service", "loraserve.v1.AdapterStore"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{store.address} loraserve.v1.AdapterStore: SERVING"

    assert cli_main(["health", store.address, "--service", "loraserve.v1.NoSuchService"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err

    store.call(store.server.begin_drain())
    assert cli_main(["health", store.address]) == 1
    assert capsys.readouterr().out.strip() == f"{store.address}: NOT_SERVING"


def test_health_without_a_server_answers_quickly(capsys) -> None:
    address = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    assert cli_main(["health", address, "--timeout", "1"]) == 3
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert err.startswith(f"{address}: ") and ("UNAVAILABLE" in err or "DEADLINE_EXCEEDED" in err)
