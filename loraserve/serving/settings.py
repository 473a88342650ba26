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

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# The allowed values of the fields every server's config has.
SERVER_CHOICES: dict[str, tuple[str, ...]] = {"log_level": LOG_LEVELS}

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
    choices: Mapping[str, Sequence[str]] | None = None,
) -> T:
    """Build `cls` (a dataclass) from flags and LORASERVE_* variables; fields in `required` default to
    "" so that the dataclass reports them missing in its own words. `choices` (plus SERVER_CHOICES)
    lists the allowed values of a field, for --help and for checking flags and variables alike."""
    env = os.environ if env is None else env
    allowed = {**SERVER_CHOICES, **(choices or {})}
    parser = argparse.ArgumentParser(prog=prog, description=description)
    kinds: dict[str, type] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = kinds[f.name] = field_kind(f.type)
        flag = "--" + f.name.replace("_", "-")
        text = f"{help.get(f.name, '')} ({_default_text(f, required)})".lstrip()
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            values_of = allowed.get(f.name)
            parser.add_argument(
                flag,
                type=_upper if values_of and all(v.isupper() for v in values_of) else kind,
                choices=values_of,
                default=None,
                help=text,
            )
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
            if name in allowed and str(value).upper() in allowed[name] and str(value) not in allowed[name]:
                value = str(value).upper()
            if name in allowed and value not in allowed[name]:
                parser.error(f"{variable}={value!r} is not one of {', '.join(allowed[name])}")
        if value is not None:
            values[name] = value
    for name in required:
        values.setdefault(name, "")
    try:
        return cls(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise


def _upper(raw: str) -> str:
    return raw.upper()


def _default_text(f: dataclasses.Field, required: Sequence[str]) -> str:
    """What --help says of a field's default (argparse itself sees None: an unset flag falls back
    to the variable, then to this default). A token's default is never shown."""
    if f.name in required or f.default is dataclasses.MISSING:
        return "required"
    d = f.default
    if isinstance(d, bool):
        return f"default: {'on' if d else 'off'}"
    if d is None or d == "":
        return "default: none"
    if f.name.endswith(("token", "key")):
        return "default: set"
    return f"default: {d}".replace("%", "%%")
