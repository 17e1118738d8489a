"""Every exercise, by lab, in the order the notebooks teach them (each topic's `exercises/`);
lookup by name."""

from __future__ import annotations

import difflib

from fsdp_lab.checkpointing.exercises import EXERCISES as CHECKPOINTING
from fsdp_lab.collectives.exercises import EXERCISES as COLLECTIVES
from fsdp_lab.exercise import Exercise
from fsdp_lab.hsdp.exercises import EXERCISES as HSDP
from fsdp_lab.meta_init.exercises import EXERCISES as META_INIT
from fsdp_lab.pipeline.exercises import EXERCISES as PIPELINE
from fsdp_lab.sharding.exercises import EXERCISES as SHARDING
from fsdp_lab.tying.exercises import EXERCISES as TYING

# lab -> its exercises; the lab names are those of `fsdp-lab <lab>`.
LABS: dict[str, tuple[Exercise, ...]] = {
    "collectives": COLLECTIVES,
    "shard": SHARDING,
    "checkpoint": CHECKPOINTING,
    "tying": TYING,
    "meta-init": META_INIT,
    "pp-seed": PIPELINE,
    "hsdp": HSDP,
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
