"""Service configuration from command-line flags and LORASERVE_* environment variables.

Each service has one config dataclass; every field `name` gets a flag `--name` (dashes) and a
variable `LORASERVE_NAME`. A flag beats the variable, the variable beats the field's default.
Invalid values (unparsable, or rejected by the dataclass's own invariant checks, which raise
ValueError) end the program with argparse's usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

# The help of the fields every server's config has.
SERVER_HELP = {
    "host": "address to listen on",
    "port": "port to listen on (0 picks a free one)",
    "tls_cert": "PEM certificate chain; serve TLS when set (with --tls-key)",
    "tls_key": "PEM private key of --tls-cert",
    "metrics_port": "serve Prometheus metrics on this port",
    "otlp_endpoint": "export OpenTelemetry traces over OTLP/gRPC to this URL, e.g. http://collector:4317 "
    "(tracing is off when empty; needs the otlp extra)",
    "log_level": "logging level",
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def field_kind(annotation: object) -> type:
    """bool, int, float or str: what a field's annotation (a string under postponed evaluation) holds."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if text.startswith(name):
            return kind
    return str


def parse_env_value(raw: str, kind: type, variable: str) -> Any:
    if kind is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(f"{variable}={raw!r} is not a boolean")
    try:
        return kind(raw)
    except ValueError as exc:
        raise ValueError(f"{variable}={raw!r} is not a valid {kind.__name__}") from exc


def config_from_args(
    cls: type[T],
    argv: Sequence[str] | None,
    env: Mapping[str, str] | None,
    *,
    prog: str,
    description: str,
    help: Mapping[str, str],
    required: Sequence[str] = (),
) -> T:
    """Build `cls` (a dataclass) from flags and LORASERVE_* variables; fields in `required` default to
    "" so that the dataclass reports them missing in its own words."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog=prog, description=description)
    kinds: dict[str, type] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = kinds[f.name] = field_kind(f.type)
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help.get(f.name)
            )
        else:
            parser.add_argument(flag, type=kind, default=None, help=help.get(f.name))
    args = parser.parse_args(list(argv or []))
    values: dict[str, Any] = {}
    for name, kind in kinds.items():
        value = getattr(args, name)
        variable = f"LORASERVE_{name.upper()}"
        if value is None and variable in env:
            try:
                value = parse_env_value(env[variable], kind, variable)
            except ValueError as exc:
                parser.error(str(exc))
        if value is not None:
            values[name] = value
    for name in required:
        values.setdefault(name, "")
    try:
        return cls(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise
