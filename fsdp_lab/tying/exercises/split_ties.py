"""Exercise of the tying lab: a tied weight must stay one copy through sharding.

`split_ties` — the tie check of a wrap plan: find the Parameters reached under two names whose
owners the plan puts in different units, so `build_plan` refuses the plan before any message is
sent. The learner's check runs inside `build_plan` (its ``split_ties=``); a plan it lets through
is sharded and trained, so a missed tie shows what it costs: each unit gathers, updates and
frees its own copy, the copies drift apart and the loss leaves one-process training. Bugs it
catches: comparing names instead of Parameter objects (no tie is ever found); walking
`named_modules()`, which lists a module registered in two places once (the tie through it is
missed); reporting every tie, split or not (a good plan is refused).

`group_tied_units` (`group_tied_units.py`) — the way out: merge the units a tie would split into one.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fsdp_lab.exercise import Bug, Case, Exercise, Mismatch, WrongOutput, close, series_of
from fsdp_lab.sharding.wrap import PlanError, UnitOf, build_plan, find_split_ties
from fsdp_lab.tying.exercises import tied_models as tm


def split_ties(model: nn.Module, unit_of: UnitOf) -> list[tuple[str, ...]]:
    """Reference: `fsdp_lab.sharding.wrap.find_split_ties` — names grouped by Parameter object, a group
    reported when its owners' units differ."""
    return find_split_ties(model, unit_of)


def _by_name(model: nn.Module, unit_of: UnitOf) -> list[tuple[str, ...]]:
    names_of: dict[str, list[str]] = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(name, []).append(name)  # a name is never another name: no tie
    return [
        tuple(n) for n in names_of.values() if len({unit_of(x.rpartition(".")[0]) for x in n}) > 1
    ]


def _named_modules_once(model: nn.Module, unit_of: UnitOf) -> list[tuple[str, ...]]:
    names_of: dict[int, list[str]] = {}
    for mname, module in model.named_modules():  # a module reached twice is listed once
        for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
            names_of.setdefault(id(p), []).append(f"{mname}.{pname}" if mname else pname)
    return [
        tuple(n) for n in names_of.values() if len({unit_of(x.rpartition(".")[0]) for x in n}) > 1
    ]


def _every_tie(model: nn.Module, unit_of: UnitOf) -> list[tuple[str, ...]]:
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    return [tuple(n) for n in names_of.values() if len(n) > 1]  # the units never compared


def _groups(got: Any) -> list[tuple[str, ...]]:
    """The learner's answer as a list of name tuples, or a WrongOutput saying what it was."""
    ok = isinstance(got, (list, tuple)) and all(
        isinstance(g, (list, tuple)) and all(isinstance(n, str) for n in g) for g in got
    )
    if not ok:
        raise WrongOutput(
            "split_ties must return a list of tuples of parameter names, e.g. "
            f"[('tok_emb.weight', 'head.weight')]; got {got!r:.80}"
        )
    return [tuple(g) for g in got]


def trial(fn: Any, case: Case) -> dict:
    p = case.params
    model = tm.build(p["model"])
    seen: list[tuple[list, list]] = []

    def checked(m: nn.Module, unit_of: UnitOf) -> list:
        groups = _groups(fn(m, unit_of))
        units = [[unit_of(n.rpartition(".")[0]) for n in g] for g in groups]
        seen.append((groups, units))
        return groups

    try:
        plan = build_plan(model, p["units"], split_ties=checked)
        refused = None
    except PlanError as exc:
        refused = str(exc)
    groups, units = seen[0]
    out: dict[str, Any] = {"reported": groups, "units": units, "refused": refused}
    if refused is None:  # what the mechanism does with the plan
        out["run"] = tm.sharded(p["model"], plan)
    model = tm.build(p["model"])
    out["one_module"] = [  # a tie whose names all lead to one module object (shared)
        len({id(model.get_submodule(n.rpartition(".")[0])) for n in g}) == 1 for g in groups
    ]
    out["one_process"] = tm.one_process(p["model"])
    return out


def _key(groups: list) -> set[frozenset[str]]:
    return {frozenset(g) for g in groups}


def _show(groups: list) -> str:
    return "; ".join("(" + ", ".join(g) + ")" for g in groups) or "none"


def judge(got_all: list[Any], expected: list[Any], case: Case) -> Mismatch | None:
    got, exp = got_all[0], expected[0]  # every rank checks the same model and plan
    one = exp["one_process"]
    missed = [g for g in exp["reported"] if frozenset(g) not in _key(got["reported"])]
    extra = [g for g in got["reported"] if frozenset(g) not in _key(exp["reported"])]
    through_one = [
        s for g, s in zip(exp["reported"], exp["one_module"], strict=True) if g in missed
    ]
    if missed and not got["reported"] and not any(through_one):
        hint = (
            "No tie found at all: the two names of a tie are different strings, so group the "
            "names by Parameter object (id(p)), listing every name with "
            "named_parameters(remove_duplicate=False)."
        )
    elif missed and all(through_one):
        hint = (
            "The missed tie goes through one module registered in two places: named_modules() "
            "lists it once — take every name from model.named_parameters(remove_duplicate=False)."
        )
    elif extra:
        hint = (
            "A tie inside one unit is safe (the unit gathers one copy for all its owners): "
            "report a tie only when unit_of(owner) differs between its names."
        )
    else:
        hint = "Report every Parameter reached under two names whose owners' units differ."
    rows = [("split ties reported", _show(exp["reported"]), _show(got["reported"]))]
    verdict = lambda r: "refused" if r else "accepted"  # noqa: E731
    rows.append(("the plan", verdict(exp["refused"]), verdict(got["refused"])))
    if got["refused"] is None:
        run = got["run"]
        if not missed and not extra and close(run["losses"], one["losses"]):
            return None
        gaps = {tuple(g): gap for g, gap in zip(run["ties"], run["gaps"], strict=True)}
        gap = max((gaps.get(tuple(g), 0.0) for g in missed), default=0.0)
        rows += [
            (f"largest gap between the tie's copies after {tm.STEPS} steps", "0", f"{gap:.3g}"),
            (
                f"loss after {tm.STEPS} steps (one process / sharded)",
                f"{one['losses'][-1]:.6g}",
                f"{run['losses'][-1]:.6g}",
            ),
        ]
        return Mismatch(
            f"your check let through a plan that splits {_show(missed)} across units; sharded, "
            f"each unit trained its own copy: after {tm.STEPS} SGD steps the copies differ by "
            f"up to {gap:.3g}, and the loss left one-process training.",
            rows=rows,
            hint=hint,
            series=series_of(
                "loss per step",
                "step",
                "loss",
                {"one process (tied)": one["losses"], "yours (plan sharded)": run["losses"]},
            ),
        )
    if not missed and not extra:
        return None
    where = "; ".join(
        f"({', '.join(g)}) all in unit {units[0]!r}"
        if len(set(units)) == 1
        else f"({', '.join(g)})"
        for g, units in zip(got["reported"], got["units"], strict=True)
        if g in extra
    )
    if exp["refused"] is None:
        what = f"refused a plan that keeps every tie in one unit: it reported {where}"
    else:
        what = "refused the plan, rightly, but reported " + _show(got["reported"])
    return Mismatch(
        f"your check {what}" + (f", and missed {_show(missed)}" if missed else "") + ".",
        rows=rows,
        hint=hint,
    )


GPT_BLOCKS = ["blocks.0", "blocks.1"]

SPLIT_TIES = Exercise(
    name="split_ties",
    lab="tying",
    title="The tie check of a wrap plan",
    statement=(
        "A tied weight is **one** `nn.Parameter` reached under two names (GPT's "
        "`tok_emb.weight` and `head.weight`). A wrap unit gathers, updates and frees its own "
        "copy of every parameter it holds, so a mechanism that accepted a plan putting the "
        "owners of a tie in different units would train two copies that drift apart (notebook "
        "03's audit shows, on your torch, which of PyTorch's FSDPs does so silently and which "
        "refuse): `build_plan` must refuse it before sharding. Write `split_ties(model, unit_of)`: return, for every Parameter "
        "reached under two or more names whose owning modules fall in different units, the "
        "tuple of all its names (an empty list: the plan is safe). `unit_of(module_name)` gives "
        "the unit of a module (`'head'` for `'head.weight'`'s owner; `''` is the root unit)."
    ),
    stub=(
        "def split_ties(model, unit_of):\n"
        '    """Every tied Parameter whose owners fall in different units, as the tuple of all\n'
        '    its names: [("tok_emb.weight", "head.weight"), ...]; [] if the plan is safe."""\n'
    ),
    hints=(
        "Two names are one tie when they lead to the same Parameter *object*: group the names "
        "by `id(p)`, not by name.",
        "`model.named_parameters()` lists a shared Parameter once; "
        "`named_parameters(remove_duplicate=False)` lists every name, also those through a "
        "module registered in two places.",
        "A name's owner is `name.rpartition('.')[0]`; report the group when "
        "`len({unit_of(owner) for each name}) > 1`.",
    ),
    solution=split_ties,
    trial=trial,
    judge=judge,
    cases=(
        Case(
            "2 ranks, untied MLP stack, every module a unit",
            2,
            {"model": "untied", "units": ["emb", *GPT_BLOCKS, "head"]},
        ),
        Case(
            "2 ranks, tied GPT, embedding and head in one unit",
            2,
            {"model": "gpt", "units": [*GPT_BLOCKS, ("tok_emb", "head")]},
        ),
        Case(
            "3 ranks, tied GPT, embedding and head in different units",
            3,
            {"model": "gpt", "units": [*GPT_BLOCKS, "tok_emb", "head"]},
        ),
        Case(
            "2 ranks, three kinds of tie, one Linear shared by two stage units",
            2,
            {
                "model": "shared",
                "units": [("emb", "head"), ("pos_in", "pos_out"), "first", "second"],
            },
        ),
    ),
    bugs=(
        Bug(
            "by-name",
            "comparing names instead of Parameter objects",
            _by_name,
            "no tie is ever found: a plan that splits the embedding from the head is sharded, "
            "and the two copies drift apart",
        ),
        Bug(
            "shared-module",
            "missing a tie through a module registered in two places",
            _named_modules_once,
            "the embedding/head tie is caught, but the Linear shared by two stage units is "
            "split: each unit trains its own copy",
        ),
        Bug(
            "every-tie",
            "reporting every tie, split or not",
            _every_tie,
            "a good plan, embedding and head in one unit, is refused",
        ),
    ),
    points=2,
    minutes=10,
)
