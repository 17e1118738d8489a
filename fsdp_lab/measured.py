"""One rule for "A took less time than B", for every lab that says so in words.

Times on a shared machine move from run to run, so a lab that times something repeats it, and
an order is claimed only when the repeats show it: A is faster than B when A's median is more
than `MARGIN` below B's *and* every repeat of A is below every repeat of B. Anything less is
"cannot be told apart" — a move inside the repeats' own spread, or within the margin, is noise.
One number per side (no repeats) is read as one repeat: the margin alone decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median

MARGIN = 0.10  # medians closer than 10 % are the same time (shared-CPU noise)


def order(a: Sequence[float], b: Sequence[float]) -> int:
    """-1 if the repeats `a` are measured faster than the repeats `b`, 1 if slower, 0 if the
    runs cannot tell them apart (see the module's rule)."""
    ma, mb = median(a), median(b)
    if ma * (1 + MARGIN) < mb and max(a) < min(b):
        return -1
    if mb * (1 + MARGIN) < ma and max(b) < min(a):
        return 1
    return 0
