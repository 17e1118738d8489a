"""Markdown tables for the text reports (`summary()` of every lab, the widgets' tables).

One builder, so that every report's table has the same shape and none imports matplotlib.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def cell(value: Any) -> str:
    """A value as a table cell: None as an em dash; a "|" inside it escaped, not a new column."""
    return "—" if value is None else str(value).replace("|", "\\|")


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table: the `header` cells, then one line per row of `rows`.

    >>> print(table(["op", "bytes"], [["all_reduce", 8]]))
    | op | bytes |
    |---|---|
    | all_reduce | 8 |
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
