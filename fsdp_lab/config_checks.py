"""A lab config's fields, each declared once (`knob`: its help and what it allows), and the
checks every frozen config shares (labs' configs, `models.LlamaConfig`), in Python terms.

A config validates itself when it is built, so a wrong value fails at once — in a notebook
cell, before any rank starts, or on the command line, where `fsdp_lab.labs.options.to_flags`
says the same message in flags. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import MISSING, Field, field, fields
from typing import Any


def is_int(value: Any, low: int = 1, high: int | None = None) -> bool:
    """An int (not a bool) in [low, high]."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    return ok and (high is None or value <= high)


def knob(
    default: Any = MISSING,
    help: str = "",
    *,
    low: float | None = None,
    high: float | None = None,
    choices: Sequence[Any] | None = None,
    fix: Any = MISSING,
    **cli: Any,
) -> Any:
    """A config field whose help and allowed values are declared once, on the field: the help
    is the ``--help`` text and names the field in an error; `low`/`high` (inclusive, `high`
    None for no upper bound) and `choices` are what `check_fields` allows; `fix` is the value
    an error proposes (default: the field's default). `cli` is what `fsdp_lab.labs.options`
    reads: ``flag``, ``metavar``, ``nargs``, ``cli=False``."""
    metadata: dict[str, Any] = {"help": help, **cli}
    if low is not None:
        metadata["range"] = (low, high)
    if choices is not None:
        metadata["choices"] = list(choices)
    if fix is not MISSING:
        metadata["fix"] = fix
    return field(default=default, metadata=metadata)


def plain_help(text: str) -> str:
    """A help text as a terminal or an error shows it: without reStructuredText's and
    Markdown's backquotes (``shard(strategy="none")`` reads as shard(strategy="none"))."""
    return text.replace("``", "").replace("`", "")


def field_help(config_cls: type) -> dict[str, str]:
    """Each field's help, as its `knob` declares it."""
    return {f.name: f.metadata.get("help", "") for f in fields(config_cls)}


def check_fields(config: Any) -> None:
    """Every field of `config` against what its `knob` allows, in declaration order: one of its
    ``choices``; within its ``range`` — an int for int fields, a finite number for float fields,
    tuples element by element; None passes where None is the default. A ValueError names the
    value, what is allowed, what the field is and the fix (``steps=0 is out of range: allowed
    an int from 1 to 100,000 (training steps). Fix: steps=5``). The highs are what a lab runs
    on one host: a value past them fails at once, not on the ranks after they started."""
    for f in fields(config):
        value, default = getattr(config, f.name), f.default
        if value is None and default is None:
            continue
        fix = f.metadata.get("fix", default)
        if str(f.type) == "bool" and not isinstance(value, bool):  # 'no' would read as True
            raise ValueError(f"{f.name}={value!r}: expected True or False. Fix: {f.name}={fix!r}")
        if "choices" in f.metadata and value not in f.metadata["choices"]:
            raise ValueError(
                f"{f.name}={value!r}: expected one of {f.metadata['choices']}. "
                f"Fix: {f.name}={fix!r}"
            )
        if "range" in f.metadata:
            _check_range(f, value, fix)


def _check_range(f: Field, value: Any, fix: Any) -> None:
    """`value` of field `f` within its knob's (low, high), or a ValueError saying so."""
    name, (low, high), integer = f.name, f.metadata["range"], "int" in str(f.type)
    values = value if isinstance(value, tuple) else (value,)
    wrong_type = not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    if integer:
        ok = all(is_int(v, int(low), None if high is None else int(high)) for v in values)
    else:
        ok = all(
            isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
            and low <= v
            and (high is None or v <= high)
            for v in values
        )
    if ok:
        return
    kind, show = ("an int", "{:,}") if integer else ("a number", "{:g}")
    if isinstance(value, tuple):
        kind = "ints" if integer else "numbers"
    allowed = (
        f"{kind} >= {show.format(low)}"
        if high is None
        else (f"{kind} from {show.format(low)} to {show.format(high)}")
    )
    if fix is None:  # the nearest allowed value
        near = value if isinstance(value, int | float) and math.isfinite(value) else low
        fix = max(near, low) if high is None else min(max(near, low), high)
    what = plain_help(f.metadata.get("help", name)).rstrip(".")
    verdict = f": expected {allowed}" if wrong_type else f" is out of range: allowed {allowed}"
    raise ValueError(f"{name}={value!r}{verdict} ({what}). Fix: {name}={fix!r}")
