"""Every exercise, by lab, in the order the notebooks teach them; lookup by name."""

from __future__ import annotations

import difflib

from fsdp_lab.exercises import (
    checkpointing,
    collectives,
    hsdp,
    meta_init,
    pp_seed,
    sharding,
    tying,
)
from fsdp_lab.exercises.exercise import Exercise

# lab -> its exercises; the lab names are those of `fsdp-lab <lab>`.
LABS: dict[str, tuple[Exercise, ...]] = {
    "collectives": collectives.EXERCISES,
    "shard": sharding.EXERCISES,
    "checkpoint": checkpointing.EXERCISES,
    "tying": tying.EXERCISES,
    "meta-init": meta_init.EXERCISES,
    "pp-seed": pp_seed.EXERCISES,
    "hsdp": hsdp.EXERCISES,
}
EXERCISES: tuple[Exercise, ...] = tuple(e for group in LABS.values() for e in group)


def exercise(name: str) -> Exercise:
    """The exercise called `name`; a ValueError naming the closest ones if there is none."""
    for e in EXERCISES:
        if e.name == name:
            return e
    names = [e.name for e in EXERCISES]
    close = difflib.get_close_matches(name, names, n=1)
    fix = f"did you mean {close[0]!r}?" if close else "the exercises are: " + ", ".join(names)
    raise ValueError(f"exercise {name!r} does not exist: {fix}")
