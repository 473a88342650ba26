"""`loraserve COMMAND --help` of every command shows each option's default (or that it has none)
and, for an option with a fixed set of values, the allowed values."""

from __future__ import annotations

import re

import pytest

from loraserve.cli import COMMANDS
from tests.helpers.cli_env import cli_help

_OPTION = re.compile(r"^  (-\w, )?--?[\w-]+")
# options with a fixed set of values: (command, option) -> values --help must list
CHOICES = {
    ("store", "--serving-dtype"): ("float32", "bfloat16", "float16"),
    ("store", "--log-level"): ("DEBUG", "INFO", "WARNING", "ERROR"),
    ("worker", "--dtype"): ("auto", "float32", "bfloat16", "float16"),
    ("worker", "--log-level"): ("DEBUG", "INFO", "WARNING", "ERROR"),
    ("openai", "--log-level"): ("DEBUG", "INFO", "WARNING", "ERROR"),
}


def option_entries(text: str) -> dict[str, str]:
    """option string (its longest name) -> its whole entry in the options list."""
    entries: dict[str, str] = {}
    current = None
    for line in text.split("options:", 1)[-1].splitlines():
        m = _OPTION.match(line)
        if m:
            names = re.findall(r"--?[\w-]+", line.split("  ", 2)[1] if "  " in line[2:] else line)
            current = max(names, key=len)
            entries[current] = line
        elif current is not None and line.startswith("   "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_shows_its_default(command: str) -> None:
    entries = option_entries(cli_help(command))
    assert entries, cli_help(command)
    missing = [
        name
        for name, entry in entries.items()
        if name not in ("--help", "--version")
        and "default" not in entry.lower()
        and "required" not in entry.lower()
    ]
    assert not missing, f"`loraserve {command} --help` shows no default for {missing}"


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_options_with_fixed_values_list_them(key: tuple[str, str]) -> None:
    command, option = key
    entry = option_entries(cli_help(command))[option]
    assert all(v in entry for v in CHOICES[key]), entry
