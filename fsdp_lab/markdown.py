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


def max_diff(a: str, b: str, value: float) -> str:
    """The one agreement sentence of every lab: the largest element-wise difference between two
    runs' parameters (`reference.max_abs_diff`), "max |ours − single process| = 3e-08"."""
    return f"max |{a} − {b}| = {value:.2g}"


def timeline_sentence(shares: dict[str, float]) -> str:
    """Markdown: `trace.timeline.time_shares` in words — how a rank's time split between
    compute, moving bytes and waiting for other ranks, and how much transfer compute hid."""

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.1f} ms"

    inside = shares["waiting"] + shares["transfer"]
    lead = (
        "more time inside collectives than computing"
        if inside > shares["compute"]
        else "more time computing than inside collectives"
    )
    hidden = shares["hidden"] / shares["transfer"] if shares["transfer"] else 0.0
    return (
        f"Measured, per rank on average over {ms(shares['span'])}: compute {ms(shares['compute'])}, "
        f"moving bytes {ms(shares['transfer'])}, waiting inside a collective for the other ranks "
        f"{ms(shares['waiting'])} — {lead} (the two overlap). Of the transfer time, {hidden:.0%} ran while the same "
        f"rank computed (hidden behind compute; an asynchronous all-gather's span runs from its "
        f"issue until the backend reports its bytes arrived, not until the rank waits for it)."
    )


def source(fn: Any) -> str:
    """Markdown: `fn`'s own code, read from the installed package, under the file it lives in —
    so a notebook shows the function the mechanism runs, never a copy of it."""
    import inspect
    from pathlib import Path

    import fsdp_lab

    where = Path(inspect.getsourcefile(fn)).relative_to(Path(fsdp_lab.__file__).parents[1])
    return f"`{where.as_posix()}`\n\n```python\n{inspect.getsource(fn).rstrip()}\n```"
