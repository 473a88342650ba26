"""The `loraserve` command line: one entry point, each subcommand implemented beside the code it
drives and imported only when used (a client machine needs no torch to run `register`)."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "store": ("loraserve.adapter_store.server", "main", "run the adapter store service"),
    "worker": ("loraserve.inference_worker.server", "main", "run an inference worker"),
    "openai": ("loraserve.gateway.server", "main", "serve the OpenAI-compatible HTTP API"),
    "up": ("loraserve.up", "main", "run a store and a worker on the embedded default"),
    "model": (
        "loraserve.inference_worker.model.fetch_cli",
        "model_main",
        "list the real-model catalog, or fetch one as a Hugging Face directory",
    ),
    "register": ("loraserve.clients.store_cli", "register_main", "register an adapter with a store"),
    "adapters": ("loraserve.clients.store_cli", "adapters_main", "list, show or delete a store's adapters"),
    "generate": ("loraserve.clients.worker_cli", "generate_main", "generate text through a worker"),
    "slots": ("loraserve.clients.worker_cli", "slots_main", "list, load, unload or pin a worker's adapters"),
    "bench": ("loraserve.clients.bench.cli", "bench_main", "load-test a worker, a fleet or an endpoint"),
    "health": (
        "loraserve.clients.health_cli",
        "health_main",
        "check a server's grpc.health.v1 status (exit 0 when serving)",
    ),
}


def _usage() -> str:
    lines = ["usage: loraserve [--version] COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines.append("\nrun `loraserve COMMAND --help` for a command's options")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from loraserve import __version__

        print(f"loraserve {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"loraserve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    result = getattr(importlib.import_module(module), func)(rest)
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
