"""Checks every frozen config shares (labs' configs, `models.LlamaConfig`), in Python terms.

A config validates itself when it is built, so a wrong value fails at once — in a notebook
cell, before any rank starts, or on the command line, where `fsdp_lab.labs.options.to_flags`
says the same message in flags. Torch-free.
"""

from __future__ import annotations

import math
import re
from dataclasses import fields
from typing import Any


def is_int(value: Any, low: int = 1, high: int | None = None) -> bool:
    """An int (not a bool) in [low, high]."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    return ok and (high is None or value <= high)


def field_help(config_cls: type) -> dict[str, str]:
    """Each field's line in the class docstring's ``Args:`` section (``a, b: text`` covers both)."""
    helps: dict[str, str] = {}
    names: list[str] = []
    for line in (config_cls.__doc__ or "").splitlines():
        match = re.match(r"\s*([a-z_0-9, ]+):\s+(.*)", line)
        if match and all(n.strip().isidentifier() for n in match.group(1).split(",")):
            names = [n.strip() for n in match.group(1).split(",")]
            for n in names:
                helps[n] = match.group(2).strip()
        elif names and line.strip():  # a continuation line
            for n in names:
                helps[n] += " " + line.strip()
    return helps


def check_counts(config: Any, lows: dict[str, int], fixes: dict[str, Any] | None = None) -> None:
    """Each named field an int >= its low bound (None allowed where None is the default), or a
    ValueError naming the value, what it counts (from the docstring) and the default as the fix.
    """
    defaults = {f.name: f.default for f in fields(config)}
    helps = field_help(type(config))
    for name, low in lows.items():
        value = getattr(config, name)
        if is_int(value, low) or (value is None and defaults[name] is None):
            continue
        what = helps.get(name, name).rstrip(".")
        fix = (fixes or {}).get(name, defaults[name])
        raise ValueError(
            f"{name}={value!r} is out of range: allowed an int >= {low} ({what}). Fix: {name}={fix}"
        )


def check_ranges(config: Any, ranges: dict[str, tuple[float, float]]) -> None:
    """Each named field within its (low, high), inclusive — an int for int fields, a finite
    number for float fields; None passes where None is the default; tuples are checked element
    by element. A ValueError names the value, the range, what the field is (from the
    docstring) and the default as the fix. The highs are what a lab can run on one host: a
    value past them fails at once, not on the ranks after they started."""
    defaults = {f.name: f.default for f in fields(config)}
    types = {f.name: str(f.type) for f in fields(config)}
    helps = field_help(type(config))
    for name, (low, high) in ranges.items():
        value = getattr(config, name)
        if value is None and defaults[name] is None:
            continue
        integer = "int" in types[name]
        values = value if isinstance(value, tuple) else (value,)
        ok = all(
            is_int(v, int(low), int(high))
            if integer
            else isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
            and low <= v <= high
            for v in values
        )
        if ok:
            continue
        what = helps.get(name, name).rstrip(".")
        kind, show = ("an int", "{:,}") if integer else ("a number", "{:g}")
        fix = defaults[name]
        if fix is None:  # the nearest allowed value
            near = value if isinstance(value, int | float) and math.isfinite(value) else low
            fix = min(max(near, low), high)
        raise ValueError(
            f"{name}={value!r} is out of range: allowed {kind} from {show.format(low)} to "
            f"{show.format(high)} ({what}). Fix: {name}={fix!r}"
        )
