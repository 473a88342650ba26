"""What a `loraserve` command accepts, read from its own `--help`: the deploy files (compose, Kubernetes)
are checked against it, so a renamed flag or variable fails a test instead of a rollout."""

from __future__ import annotations

import contextlib
import functools
import io
import re

from loraserve.cli import COMMANDS
from loraserve.cli import main as cli_main

# The services fill one config object from flags and LORASERVE_<FLAG> variables
# (clients/settings.py); the client commands name the variables they read in their help.
SERVICES = ("store", "worker", "openai")

_FLAG = re.compile(r"(?<![\w-])--([a-z0-9][a-z0-9-]*)")
_VARIABLE = re.compile(r"\bLORASERVE_[A-Z0-9_]+\b")


class UnknownCommand(LookupError):
    pass


@functools.cache
def cli_help(command: str) -> str:
    if command not in COMMANDS:
        raise UnknownCommand(f"`loraserve {command}` is not a command of this build ({', '.join(COMMANDS)})")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli_main([command, "--help"])
    text = out.getvalue()
    assert text.startswith("usage: loraserve"), f"`loraserve {command} --help` printed no usage:\n{text}"
    return text


def cli_flags(command: str) -> frozenset[str]:
    """Long option names without dashes ("grace-period-s"), --help excluded."""
    return frozenset(_FLAG.findall(cli_help(command))) - {"help"}


def accepted_env(command: str) -> frozenset[str]:
    if command in SERVICES:
        return frozenset(
            "LORASERVE_" + flag.upper().replace("-", "_")
            for flag in cli_flags(command)
            if not flag.startswith("no-")
        )
    return frozenset(_VARIABLE.findall(cli_help(command)))


def flags_used(argv: list[str]) -> list[str]:
    """The long options of an argument list ("--port=1" and "--port 1" alike)."""
    return [a[2:].split("=", 1)[0] for a in argv if a.startswith("--")]


# Variables the deploy files set ahead of the code that reads them: (command, variable) -> what it is.
# An entry must go once the command accepts the variable: env_problems() then reports it.
AWAITED: dict[tuple[str, str], str] = {}


def env_problems(command: str, variables: list[str], where: str) -> list[str]:
    """Each LORASERVE_* variable that `loraserve COMMAND` does not read, as a message naming `where`."""
    accepted = accepted_env(command)
    problems = []
    for name in variables:
        if not name.startswith("LORASERVE_"):
            continue
        awaited = (command, name) in AWAITED
        if name not in accepted and not awaited:
            problems.append(f"{where}: {name} is not read by `loraserve {command}`")
        if name in accepted and awaited:
            problems.append(f"{where}: `loraserve {command}` now reads {name}: drop it from AWAITED")
    return problems
