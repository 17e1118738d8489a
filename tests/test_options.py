"""fsdp_lab.labs.options: a config dataclass becomes command-line options, and its errors come
back in the options' words. No ranks, no torch."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from fsdp_lab.labs.options import add_config_arguments, config_overrides, field_help, to_flags


@dataclass(frozen=True)
class _Config:
    """Args:
    world_size: ranks.
    steps: training steps.
    lr: learning rate.
    sizes_mb: model sizes (MiB) of the table,
        one row each.
    strategy: how to shard.
    prefetch: overlap the next unit's gather.
    measure_70b: build the 70B model.
    verbose: say more.
    dim, heads: the model's width and heads.
    budget: optional budget.
    secret: not an option.
    backend: "auto", "gloo" or "nccl".
    """

    world_size: int = 2
    steps: int = 5
    lr: float = 0.1
    sizes_mb: tuple[int, ...] = (16, 64)
    strategy: str = field(default="full", metadata={"choices": ("full", "none")})
    prefetch: bool = True
    measure_70b: bool = field(default=True, metadata={"flag": "--no-70b"})
    verbose: bool = False
    dim: int = 32
    heads: int = 4
    budget: int | None = None
    secret: str = field(default="x", metadata={"cli": False})
    backend: str = "auto"


def _parse(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, _Config)
    return config_overrides(parser.parse_args(list(argv)), _Config)


def test_every_field_is_an_option_typed_from_its_annotation():
    got = _parse(
        "--steps", "7", "--lr", "0.5", "--sizes-mb", "8", "16", "--strategy", "none",
        "--no-prefetch", "--no-70b", "--verbose", "--budget", "3",
    )  # fmt: skip
    assert got == {
        "steps": 7,
        "lr": 0.5,
        "sizes_mb": (8, 16),  # a tuple, as the frozen config wants
        "strategy": "none",
        "prefetch": False,
        "measure_70b": False,
        "verbose": True,
        "budget": 3,
    }
    assert _parse() == {}  # nothing given: the config's defaults stand


def test_common_and_hidden_fields_are_not_generated():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, _Config)
    flags = {a for action in parser._actions for a in action.option_strings}
    assert "--secret" not in flags and "--world-size" not in flags and "--backend" not in flags
    with pytest.raises(SystemExit):
        parser.parse_args(["--strategy", "zero4"])  # choices from the metadata


def test_help_comes_from_the_args_section():
    helps = field_help(_Config)
    assert helps["steps"] == "training steps."
    assert helps["sizes_mb"] == "model sizes (MiB) of the table, one row each."
    assert helps["dim"] == helps["heads"] == "the model's width and heads."
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, _Config)
    shown = {a.dest: a.help for a in parser._actions}
    # --no-prefetch skips what the docstring describes (on by default); --verbose turns on what it says
    assert shown["prefetch"] == (
        "by default the lab does this: overlap the next unit's gather. This flag skips it."
    )
    assert shown["verbose"] == "say more."


@pytest.mark.parametrize(
    ("python", "cli"),
    [
        ("steps=0: expected an int >= 1. Fix: steps=5", "--steps 0: expected an int >= 1. Fix: --steps 5"),
        ("sizes_mb=(16, 0) is out of range", "--sizes-mb 16 0 is out of range"),
        ("dim=30 is not divisible by heads=4", "--dim 30 is not divisible by --heads 4"),
        ("Fix: world_size=2", "Fix: --world-size 2"),
        ("Fix: measure_70b=False", "Fix: --no-70b"),
        ("Fix: prefetch=True", "Fix: no --no-prefetch"),
        ("Fix: verbose=True", "Fix: --verbose"),
        ("strategy='zero4' is unknown", "--strategy zero4 is unknown"),
        ("the model.steps=3 attribute", "the model.steps=3 attribute"),  # not a field name here
    ],
)  # fmt: skip
def test_errors_are_spoken_back_as_options(python, cli):
    assert to_flags(python, _Config) == cli
