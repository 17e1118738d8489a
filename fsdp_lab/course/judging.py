"""Helpers every exercise's judge uses: closeness, the ratio that names a bug, curves to draw.

Tolerances are for values two correct programs may order differently (a sum then a division
vs a multiplication by 1/N): a wrong mechanism is off by a factor, a shard, a sign, never by
1e-6 of the value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

RTOL, ATOL = 1e-5, 1e-7


def close(got: Sequence[float] | torch.Tensor, expected: Sequence[float] | torch.Tensor) -> bool:
    """Same length and equal to within float reordering."""
    g, e = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return g.shape == e.shape and bool(torch.allclose(g, e, rtol=RTOL, atol=ATOL))


def ratio(got: Sequence[float], expected: Sequence[float]) -> float | None:
    """The factor `got` is of `expected` (least squares), or None if `expected` is all zero."""
    g, e = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    if g.shape != e.shape or float(e @ e) == 0.0:
        return None
    return float((g @ e) / (e @ e))


def multiple(got: Sequence[float], expected: Sequence[float]) -> str:
    """ " (2× the reference's)" when `got` is exactly a multiple of `expected` (to float
    reordering), else "": a factor only where it explains every value."""
    k = ratio(got, expected)
    if k is None or abs(k - 1) < 1e-6 or not close(got, [k * v for v in expected]):
        return ""
    return f" ({k:.3g}× the reference's)"


def ratio_hint(
    got: Sequence[float], expected: Sequence[float], hints: dict[float, str], default: str = ""
) -> str:
    """The hint of the factor `got` is of `expected`, when it is one of `hints`' keys and
    `got` is that multiple exactly (not merely correlated); else `default`."""
    k = ratio(got, expected)
    if k is not None:
        for factor, hint in hints.items():
            scaled = [factor * v for v in expected]
            if abs(k - factor) <= 1e-4 * max(1.0, abs(factor)) and close(got, scaled):
                return hint
    return (
        default
        or "Compare your function with the statement line by line: the table above "
        "shows the first values that differ."
    )


def series_of(
    title: str, xlabel: str, ylabel: str, lines: dict[str, list[float]], in_bytes: bool = False
) -> dict[str, Any]:
    """Curves for `Mismatch.series`: the reference first."""
    return {"title": title, "xlabel": xlabel, "ylabel": ylabel, "lines": lines, "bytes": in_bytes}
