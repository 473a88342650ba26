"""Plain-text tables of the command line: left-aligned columns two spaces apart."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """The header and rows, each column as wide as its widest cell; trailing spaces stripped."""
    lines = [tuple(header)] + [tuple(r) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )
