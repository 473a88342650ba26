"""Options and output every client command shares, named once: `--tls` / `--tls-ca` to reach a
TLS server, `--json` for machine-readable output, and a progress display on the terminal.

Exit statuses of the client commands (docs/operations.md lists them all): 0 done, 1 the server
answered with an error (or none could be reached), 2 bad usage (argparse's), 3 no answer from
`loraserve health`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

OK, FAILED, USAGE, NO_ANSWER = 0, 1, 2, 3


def add_tls_args(parser: argparse.ArgumentParser | Any, suppress: bool = False) -> None:
    """--tls (verify with the system's roots) and --tls-ca PEM (verify with these; implies --tls).
    `suppress` leaves the defaults to a parent parser (options repeated on subcommands)."""
    parser.add_argument(
        "--tls",
        action="store_true",
        default=argparse.SUPPRESS if suppress else False,
        help="connect with TLS",
    )
    parser.add_argument(
        "--tls-ca",
        metavar="PEM",
        default=argparse.SUPPRESS if suppress else None,
        help="PEM CA bundle to verify the server's certificate with (implies --tls)",
    )


def add_json_arg(parser: argparse.ArgumentParser | Any, suppress: bool = False) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS if suppress else False,
        help="print JSON instead of a table or text",
    )


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=False))


@contextmanager
def progress(description: str) -> Iterator[None]:
    """A spinner with the elapsed time on stderr while the block runs, when stderr is a terminal
    and rich is installed (it comes with the server extra; the thin client shows nothing)."""
    if not sys.stderr.isatty():
        yield
        return
    try:
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    except ImportError:
        yield
        return
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=Console(stderr=True)
    ) as bar:
        bar.add_task(description, total=None)
        yield


@contextmanager
def progress_bar(description: str) -> Iterator[Callable[[int, int], None] | None]:
    """A bar on stderr fed by the callback the block gets, `(done, total)`; the block gets None when
    stderr is no terminal or rich is missing (logs stay clean in containers)."""
    if not sys.stderr.isatty():
        yield None
        return
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        yield None
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    ) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type of a count of at least 1 (--max-tokens, -n): the request's 0 means the
    server's default, which a command line that shows its own default must not send unasked."""
    k = _whole_number(text)
    if k < 1:
        raise argparse.ArgumentTypeError(f"need a whole number >= 1, got {k}")
    return k


def nonnegative_int(text: str) -> int:
    """argparse type of a count that may be 0 (--top-logprobs)."""
    k = _whole_number(text)
    if k < 0:
        raise argparse.ArgumentTypeError(f"need a whole number >= 0, got {k}")
    return k


def stream_interval(text: str) -> int:
    """argparse type of --stream-interval K: GenerateRequest.stream_interval's range."""
    from loraserve.contract.streaming import MAX_STREAM_INTERVAL

    k = _whole_number(text)
    if not 0 <= k <= MAX_STREAM_INTERVAL:
        raise argparse.ArgumentTypeError(f"need 0 <= K <= {MAX_STREAM_INTERVAL}, got {k}")
    return k
