"""The --help of the client commands (and of `up`): every option shows its default, or that it
has none; an option with a fixed set of values lists them through argparse's `choices`. A token
or key taken from the environment is never printed."""

from __future__ import annotations

import argparse

_SECRET_WORDS = ("token", "key")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    def add_argument(self, action: argparse.Action) -> None:
        if action.help is None and action.option_strings and action.default is not argparse.SUPPRESS:
            action.help = (
                f"({_default_text(action)})"  # argparse lists an option's help only when it has some
            )
        super().add_argument(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            not action.option_strings
            or action.default is argparse.SUPPRESS
            or isinstance(action, (argparse._HelpAction, argparse._VersionAction))
            or "default" in text.lower()
        ):
            return text
        return f"{text} ({_default_text(action)})".lstrip()


def _default_text(action: argparse.Action) -> str:
    d = action.default
    if action.required:
        return "required"
    if action.nargs == 0 or isinstance(d, bool):  # a switch
        return f"default: {'on' if d else 'off'}"
    if d is None or d == "" or d == []:
        return "default: none"
    if action.dest.endswith(_SECRET_WORDS):
        return "default: set from the environment"
    return "default: %(default)s"
