"""A lab's command-line options, generated from its config dataclass — and its errors, spoken back
in flags.

Every field becomes an option named after it (``global_batch`` -> ``--global-batch``), typed from
its annotation (int, float, str, tuples as several values), helped by the help its
`fsdp_lab.config_checks.knob` declares; a bool that defaults to True becomes ``--no-<name>``. The
knob may say more: ``flag`` (another spelling, e.g. ``--no-70b``), ``choices``, ``nargs``, or
``cli=False`` to keep it out of the CLI. `COMMON` fields are every lab's options (`cli.py`).

Configs validate in Python terms (``steps=0: expected an int >= 1. Fix: steps=5``), which is
what a notebook user types; `to_flags` says the same sentence on the command line
(``--steps 0: expected an int >= 1. Fix: --steps 5``). Torch-free.
"""

from __future__ import annotations

import argparse
import ast
import re
from dataclasses import MISSING, Field, fields
from typing import Any

from fsdp_lab.config_checks import field_help, plain_help

COMMON = ("world_size", "backend", "model")  # options of every lab, added by cli.py
_SCALARS = {"int": int, "float": float, "str": str}


def _base_type(field: Field) -> tuple[str, bool]:
    """(the annotation without ``| None``, whether it is a tuple of that type)."""
    text = str(field.type).replace(" ", "").removesuffix("|None")
    match = re.fullmatch(r"tuple\[(\w+),\.\.\.\]", text)
    return (match.group(1), True) if match else (text, False)


def _default(field: Field) -> Any:
    if field.default is not MISSING:
        return field.default
    return field.default_factory() if field.default_factory is not MISSING else None


def cli_fields(config_cls: type) -> list[Field]:
    """The fields that are this lab's own options (not `COMMON`, not ``cli=False``)."""
    return [
        f
        for f in fields(config_cls)
        if f.name not in COMMON and f.metadata.get("cli", True) and f.init
    ]


def flag_of(field: Field) -> str:
    """The option of `field`: its metadata's ``flag``, ``--no-<name>`` for a bool defaulting to
    True, else ``--<name>`` with dashes."""
    if "flag" in field.metadata:
        return field.metadata["flag"]
    dashed = field.name.replace("_", "-")
    if _base_type(field)[0] == "bool" and _default(field) is True:
        return f"--no-{dashed}"
    return f"--{dashed}"


def add_config_arguments(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """One option per field of `config_cls`; unset options stay None (the config's default)."""
    helps = field_help(config_cls)
    for f in cli_fields(config_cls):
        base, is_tuple = _base_type(f)
        default = _default(f)
        text = plain_help(helps.get(f.name, ""))
        if default not in (None, ()) and base != "bool":
            shown = " ".join(map(str, default)) if is_tuple else default
            text = f"{text.rstrip('.')} (default {shown})" if text else f"default {shown}"
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": text or None}
        if base == "bool":
            kwargs["action"] = "store_false" if default is True else "store_true"
            if default is True and text:  # the flag turns off what the help describes
                what = re.sub(r"[;,]?\s*\(?on by default\)?\.?$", "", text).rstrip(".")
                kwargs["help"] = f"by default the lab does this: {what}. This flag skips it."
        else:
            kwargs["type"] = _SCALARS.get(base, str)
            if is_tuple:
                kwargs["nargs"] = f.metadata.get("nargs", "+")
            for key in ("choices", "metavar"):
                if key in f.metadata:
                    kwargs[key] = f.metadata[key]
        parser.add_argument(flag_of(f), **kwargs)


def config_overrides(args: argparse.Namespace, config_cls: type) -> dict[str, Any]:
    """The options given on the command line, as config keyword arguments."""
    out: dict[str, Any] = {}
    for f in cli_fields(config_cls):
        value = getattr(args, f.name, None)  # the tour's parser has only the common options
        if value is None:
            continue
        out[f.name] = tuple(value) if _base_type(f)[1] else value
    return out


_VALUE = r"(\([^)]*\)|\[[^\]]*\]|'[^']*'|\"[^\"]*\"|[^\s,;:)]+)"


def _spoken(field: Field, value: str) -> str:
    """``name=value`` in Python terms as the command line says it."""
    flag = flag_of(field)
    try:
        literal = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return f"{flag} {value}"
    if isinstance(literal, bool):  # a switch: given or not
        wanted = literal != (_default(field) is True)
        return flag if wanted else f"no {flag}"
    if isinstance(literal, (tuple, list)):
        return " ".join([flag, *map(str, literal)])
    if literal is None:
        return f"no {flag}"
    return f"{flag} {literal}"


def to_flags(message: str, config_cls: type) -> str:
    """`message` with each ``field=value`` of `config_cls` written as its command-line option.

    >>> to_flags("steps=0: expected an int >= 1. Fix: steps=5", ShardConfig)
    '--steps 0: expected an int >= 1. Fix: --steps 5'
    """
    by_name = {f.name: f for f in fields(config_cls) if f.metadata.get("cli", True)}
    names = "|".join(sorted(map(re.escape, by_name), key=len, reverse=True))
    if not names:
        return message
    pattern = re.compile(rf"(?<![\w.-])({names})={_VALUE}")
    return pattern.sub(lambda m: _spoken(by_name[m.group(1)], m.group(2)), message)
