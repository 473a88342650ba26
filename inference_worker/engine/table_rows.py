"""The step's block tables as one int32 buffer, without converting every block id of every table
at every step.

A sequence's block table (a list of block ids) only grows in place (BlockManager extends it) or is
replaced by a new list (freed, forked, preempted). So a C int array per sequence can follow its
list by identity and length from step to step, taking only the ids appended since, and a step's
buffer is whole arrays copied one after another. A step's sequences are kept; the others dropped.
"""

from __future__ import annotations

from array import array

_ZERO_ROW = array("i", [0])


class TableRows:
    def __init__(self) -> None:
        self._rows: dict[int, tuple[list[int], array]] = {}
        self._zeros = array("i")

    def pack(self, head: list[int], keys: list[int | None], tables: list[list[int]], width: int) -> array:
        """`head`, then each table padded with zeros to `width` columns. keys[i]: the sequence of
        tables[i] (its seq_id), or None for a padding row's [0]."""
        out = array("i", head)
        if len(self._zeros) < width:
            self._zeros = array("i", bytes(4 * width))
        zeros = self._zeros
        rows: dict[int, tuple[list[int], array]] = {}
        for key, table in zip(keys, tables, strict=True):
            row = _ZERO_ROW if key is None else self._row(key, table, rows)
            out += row
            if len(row) < width:
                out += zeros[: width - len(row)]
        self._rows = rows
        return out

    def _row(self, key: int, table: list[int], rows: dict[int, tuple[list[int], array]]) -> array:
        known = self._rows.get(key)
        row = None
        if known is not None and known[0] is table:
            row = known[1]
            n = len(row)
            # grown in place since (never shrunk or rewritten: a new list then)
            if n > len(table) or (n and row[-1] != table[n - 1]):
                row = None
            elif n < len(table):
                row.extend(table[n:])
        if row is None:
            row = array("i", table)
        rows[key] = (table, row)
        return row
