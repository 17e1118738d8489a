"""fsdp_lab.labs.options: a config dataclass becomes command-line options, and its errors come
back in the options' words. No ranks, no torch."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from fsdp_lab.config_checks import check_fields, knob
from fsdp_lab.labs.options import add_config_arguments, config_overrides, field_help, to_flags


@dataclass(frozen=True)
class _Config:
    """Each field's help on the field, as a lab's config declares it."""

    world_size: int = knob(2, "ranks.")
    steps: int = knob(5, "training steps.", low=1, high=100)
    lr: float = knob(0.1, "learning rate.", low=1e-8, high=10.0)
    sizes_mb: tuple[int, ...] = knob((16, 64), "model sizes (MiB) of the table, one row each.")
    strategy: str = knob("full", "how to shard.", choices=("full", "none"))
    prefetch: bool = knob(True, "overlap the next unit's gather.")
    measure_70b: bool = knob(True, "build the 70B model.", flag="--no-70b")
    verbose: bool = knob(False, "say more.")
    dim: int = knob(32, "the model's width.")
    heads: int = knob(4, "attention heads.")
    budget: int | None = knob(None, "optional budget.", low=2, high=8)
    secret: str = knob("x", "not an option.", cli=False)
    backend: str = knob("auto", '"auto", "gloo" or "nccl".')


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


def test_help_and_allowed_values_come_from_the_field():
    helps = field_help(_Config)
    assert helps["steps"] == "training steps."
    assert helps["sizes_mb"] == "model sizes (MiB) of the table, one row each."
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, _Config)
    shown = {a.dest: a.help for a in parser._actions}
    # --no-prefetch skips what the docstring describes (on by default); --verbose turns on what it says
    assert shown["prefetch"] == (
        "by default the lab does this: overlap the next unit's gather. This flag skips it."
    )
    assert shown["verbose"] == "say more."


@dataclass(frozen=True)
class _Checked(_Config):
    def __post_init__(self) -> None:
        check_fields(self)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"steps": 0}, "steps=0 is out of range: allowed an int from 1 to 100 (training steps). Fix: steps=5"),
        ({"steps": True}, "steps=True: expected an int from 1 to 100"),  # a bool is not a count
        ({"lr": float("nan")}, "lr=nan is out of range: allowed a number from 1e-08 to 10"),
        ({"budget": 9}, "budget=9 is out of range: allowed an int from 2 to 8 (optional budget). Fix: budget=8"),
        ({"strategy": "zero4"}, "strategy='zero4': expected one of ['full', 'none']. Fix: strategy='full'"),
    ],
)  # fmt: skip
def test_check_fields_allows_what_each_field_declares(given, message):
    _Checked(budget=None)  # None where None is the default
    with pytest.raises(ValueError) as err:
        _Checked(**given)
    assert str(err.value).startswith(message)


def test_every_labs_fields_say_what_they_are():
    from fsdp_lab.labs.registry import LABS

    for name, lab in LABS.items():
        config = lab.part("config").CONFIG
        silent = [f for f, text in field_help(config).items() if not text]
        assert not silent, f"{name}: fields without help {silent}"


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


def test_an_explorer_offers_only_what_its_config_allows():
    from fsdp_lab.explorer import MAX_RANKS, control
    from fsdp_lab.sharding.lab.config import ShardConfig
    from fsdp_lab.sharding.lab.explorer import ShardExplorer

    explorer = ShardExplorer()
    assert (
        list(explorer.strategy.options)
        == ShardConfig.__dataclass_fields__["strategy"].metadata["choices"]
    )
    assert (explorer.world_size.min, explorer.world_size.max) == (1, MAX_RANKS)
    # the config's own bound wins over a wider limit
    assert control(_Config, "budget", 4, "budget", max=100).max == 8
    explorer.close()


def _config(lab: str) -> type:
    from fsdp_lab.labs.registry import LABS

    return LABS[lab].part("config").CONFIG


@pytest.mark.parametrize(
    ("lab", "given"),
    [
        ("shard", {"steps": 0}), ("shard", {"steps": "3"}), ("shard", {"prefetch": "no"}),
        ("shard", {"lr": float("nan")}), ("shard", {"strategy": "zero3"}),
        ("hsdp", {"overlap": 2.0}), ("hsdp", {"emulate_steps": 1}), ("hsdp", {"params_b": -1.0}),
        ("pp-seed", {"scale_dim": 0}), ("pp-seed", {"stages": 0}), ("pp-seed", {"lr": -1.0}),
        ("pp-seed", {"seed": -1}), ("meta-init", {"sizes_mb": ()}), ("meta-init", {"model_mb": 4}),
        ("tying", {"vocab": 0}), ("collectives", {"numel": 0}), ("checkpoint", {"dim": 0}),
    ],
)  # fmt: skip
def test_every_fix_an_error_proposes_is_accepted(lab, given):
    """A hostile review found a fix the config itself refused (scale_dim=0 -> scale_dim=1)."""
    import ast
    import re

    config = _config(lab)
    with pytest.raises(ValueError) as err:
        config(**given)
    message = str(err.value)
    assert "`" not in message, message  # no markup in an error a terminal prints
    name, value = re.search(r"Fix: (\w+)=(.+?)(?:,? or |$)", message).groups()
    config(**{**given, name: ast.literal_eval(value)})


@pytest.mark.parametrize(
    ("build", "given"),
    [
        ("fsdp_lab.sharding.lab.explorer:shard_explorer", {"strategy": "ful"}),
        ("fsdp_lab.sharding.lab.explorer:shard_explorer", {"prefetch": "no"}),
        ("fsdp_lab.sharding.lab.explorer:shard_explorer", {"world_size": 9}),
        ("fsdp_lab.pipeline.lab.explorer:PPSeedExplorer", {"strategy": "same_sed"}),
        ("fsdp_lab.pipeline.lab.explorer:PPSeedExplorer", {"layers": 100}),
        ("fsdp_lab.collectives.lab.explorer:CollectivesExplorer", {"numel": 1000}),
        ("fsdp_lab.meta_init.lab.explorer:meta_init_explorer", {"model_mb": "64"}),
        ("fsdp_lab.checkpointing.lab.explorer:checkpoint_explorer", {"schedule": "segment"}),
        ("fsdp_lab.hsdp.lab.explorer:scaling_explorer", {"params_b": float("nan")}),
    ],
)
def test_an_explorer_refuses_a_start_it_does_not_offer_and_names_the_fix(build, given):
    """A hostile review: these were a 49-line traitlets error, a KeyError, a TypeError, or a
    slider that quietly moved 9 ranks to 4."""
    import ast
    import importlib
    import re

    module, name = build.split(":")
    make = getattr(importlib.import_module(module), name)
    with pytest.raises(ValueError) as err:
        make(**given)
    field, fix = re.search(r"Fix: (\w+)=(.+)$", str(err.value)).groups()
    assert field in given and f"{field}={given[field]!r}" in str(err.value)
    widget = make(**{field: ast.literal_eval(fix)})
    getattr(widget, "close", lambda: None)()
