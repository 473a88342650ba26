"""What the deploy files must ask of Redis, which serves the store's registry: an append-only
file fsynced every second (a restart, even a kill, loses a second of writes at most), read from
the `redis-server --name value ...` command line they run it with."""

from __future__ import annotations

DURABLE = {"appendonly": "yes", "appendfsync": "everysec"}


def redis_server_options(argv: list[str]) -> dict[str, str]:
    """`["redis-server", "--name", "value", ...]` -> {name: value}."""
    assert argv[0] == "redis-server" and len(argv) % 2 == 1, argv
    names, values = argv[1::2], argv[2::2]
    assert all(n.startswith("--") for n in names), argv
    return {n[2:]: v for n, v in zip(names, values, strict=True)}
