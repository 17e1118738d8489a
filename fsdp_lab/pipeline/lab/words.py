"""Lab 05's small helpers for sentences built from results: lists of strategies in words."""

from __future__ import annotations

from typing import Any

from fsdp_lab.pipeline.lab.pictures import label


def join(items: list[str]) -> str:
    """ "a", "a and b", "a, b and c"."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def labels(strategies: list[str]) -> str:
    """ "(a) seed_checkpoint and (d) rng_replay"."""
    return join([label(s) for s in strategies])


def verb(items: list[Any], one: str, many: str) -> str:
    """The verb form that agrees with how many `items` there are."""
    return one if len(items) == 1 else many
