"""Exercise of the tying lab: mend a wrap plan that splits a tie, instead of refusing it.

`group_tied_units` — given a plan's units (each a tuple of module names), return units in which
the owners of every tied Parameter share one unit: the units a tie would split become one group
unit (FSDP2's ``fully_shard([model.tok_emb, model.head])``), every other unit stays. It runs
inside `build_plan` (its ``mend_ties=``); the mended plan is then sharded and trained, and must
match one-process training with the same units as the reference. Bugs it catches: mending only
the first tie; moving one owner out of its unit (the other keeps its own: still split); adding
the group but keeping the old units (a module in two units); leaving the tied modules to the
root unit (right values, but the root — gathered for the whole step — grows by the tied
weight: measured, the peak memory of the step).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fsdp_lab.exercise import Bug, Case, Exercise, Mismatch, WrongOutput, close, series_of
from fsdp_lab.sharding.ties import find_ties
from fsdp_lab.sharding.wrap import (
    PlanError,
    build_plan,
    group_tied_units,
    unit_name,
    unit_of_module,
)
from fsdp_lab.tying.exercises import tied_models as tm

Units = list[tuple[str, ...]]


def _split(model: nn.Module, units: Units) -> list[list[str]]:
    """The owner modules of every tie that `units` splits (the bugs' shared first step)."""
    owners = [list(t.modules) for t in find_ties(model) if t.kind == "identity"]
    return [o for o in owners if len({unit_of_module(m, units) for m in o}) > 1]


def _first_tie_only(model: nn.Module, units: Units) -> Units:
    for owners in _split(model, units)[:1]:
        held = {unit_of_module(m, units) for m in owners}
        merged = tuple(m for u in units if unit_name(u) in held for m in u)
        units = [u for u in units if unit_name(u) not in held] + [merged]
    return units


def _move_one_owner(model: nn.Module, units: Units) -> Units:
    for owners in _split(model, units):  # the head leaves its unit; the embedding keeps its own
        units = [u for u in units if unit_name(u) != unit_of_module(owners[-1], units)]
    return units


def _keep_old_units(model: nn.Module, units: Units) -> Units:
    groups = [tuple(o) for o in _split(model, units)]
    return list(units) + groups  # the owners' own units are still there


def _to_root(model: nn.Module, units: Units) -> Units:
    for owners in _split(model, units):  # every owner's unit dropped: the root takes the tie
        held = {unit_of_module(m, units) for m in owners}
        units = [u for u in units if unit_name(u) not in held]
    return units


def _as_units(got: Any) -> Units:
    ok = isinstance(got, (list, tuple)) and all(
        isinstance(u, str) or (isinstance(u, (list, tuple)) and all(isinstance(m, str) for m in u))
        for u in got
    )
    if not ok:
        raise WrongOutput(
            "group_tied_units must return a list of units, each a tuple of module names, e.g. "
            f"[('tok_emb', 'head'), ('blocks.0',)]; got {got!r:.80}"
        )
    return [(u,) if isinstance(u, str) else tuple(u) for u in got]


def trial(fn: Any, case: Case) -> dict:
    p = case.params
    model = tm.build(p["model"])
    given = [(u,) if isinstance(u, str) else tuple(u) for u in p["units"]]
    ties = [list(t.modules) for t in find_ties(model)]
    out: dict[str, Any] = {
        "one_process": tm.one_process(p["model"]),
        "ties": ties,
        "given": [[unit_of_module(m, given) for m in t] for t in ties],
    }
    returned: list[Units] = []

    def checked(m: nn.Module, units: Units) -> Units:
        returned.append(_as_units(fn(m, [tuple(u) for u in units])))
        return returned[-1]

    model = tm.build(p["model"])
    try:
        plan = build_plan(model, p["units"], mend_ties=checked)
    except PlanError as exc:
        units = returned[0]
        placed = [[unit_of_module(m, units) for m in t] for t in ties]
        return {**out, "units": units, "refused": str(exc), "placed": placed}
    return {**out, "units": returned[0], "refused": None, "run": tm.sharded(p["model"], plan, True)}


def _shown(units: Units) -> str:
    return ", ".join(unit_name(u) for u in units) or "none (all in the root)"


def judge(got_all: list[Any], expected: list[Any], case: Case) -> Mismatch | None:
    got, exp = got_all[0], expected[0]  # every rank mends the same plan
    one = exp["one_process"]
    rows = [("units", _shown(exp["units"]), _shown(got["units"]))]
    if got["refused"] is not None:
        message = got["refused"]
        if "listed in two units" in message:
            hint = (
                "You added the group but kept the owners' old units: a module belongs to one "
                "unit — replace the units a tie splits by their merged group."
            )
        else:
            split = [
                (t, g, p)
                for t, g, p in zip(exp["ties"], exp["given"], got["placed"], strict=True)
                if len(set(p)) > 1
            ]
            untouched = [s for s in split if s[1] == s[2]]
            if untouched:
                hint = (
                    f"The tie of {' and '.join(untouched[0][0])} is still split as given: mend "
                    "every tie — loop over all of find_ties(model), not only the first."
                )
            else:
                hint = (
                    "Moving one owner out of its unit leaves the tie split (its partner still "
                    "has a unit of its own): merge the units of all owners into one group."
                )
        return Mismatch(
            f"build_plan refused your mended plan: {message.split('. ')[0]}.",
            rows=rows + [("the plan", "accepted", "refused")],
            hint=hint,
        )
    run, ref = got["run"], exp["run"]
    drift = not close(run["losses"], one["losses"]) or any(g != 0.0 for g in run["gaps"])
    same = {frozenset(u) for u in got["units"]} == {frozenset(u) for u in exp["units"]}
    if same and not drift:
        return None
    root = dict(run["units"]).get("", 0), dict(ref["units"]).get("", 0)
    rows += [
        ("elements in the root unit", str(root[1]), str(root[0])),
        (
            "peak memory of the steps (bytes, measured)",
            str(ref["peak_bytes"]),
            str(run["peak_bytes"]),
        ),
        (f"loss after {tm.STEPS} steps", f"{one['losses'][-1]:.6g}", f"{run['losses'][-1]:.6g}"),
    ]
    if drift:
        summary = "your plan was sharded, but training left the one-process run (a tie broke)."
        hint = "Every owner of a tie must end in one unit, and no other module may move."
    elif root[0] > root[1]:
        summary = (
            f"your plan leaves the tied modules to the root unit: it trains right, but the root, "
            f"gathered for the whole step, holds {root[0]} elements instead of {root[1]}, and "
            f"the step's peak is {run['peak_bytes']} bytes instead of {ref['peak_bytes']}."
        )
        hint = (
            "Dropping the owners' units is legal but costly: group the owners into one unit "
            "of their own (a tuple of their modules), like fully_shard([emb, head])."
        )
    else:
        summary = "your plan trains right, but its units are not the reference's."
        hint = "Change only the units a tie splits; keep every other unit as it was given."
    return Mismatch(
        summary,
        rows=rows,
        hint=hint,
        series=series_of(
            "memory of the sharded steps under each plan (rank 0)",
            "tensor allocated or freed, in order",
            "memory",
            {"reference": ref["memory"], "yours": run["memory"]},
            in_bytes=True,
        ),
    )


GROUP_TIED_UNITS = Exercise(
    name="group_tied_units",
    lab="tying",
    title="Mend a wrap plan that splits a tie",
    statement=(
        "`build_plan` refuses a plan whose units split a tie. Better than refusing: mend it. "
        "Write `group_tied_units(model, units)`: `units` lists the plan's units, each a tuple "
        "of module names (`('blocks.0',)`; the root unit is not listed). Return the units with "
        "every tie inside one unit: the units holding owners of one tied Parameter become "
        "**one group unit** with all their modules (FSDP2's `fully_shard([emb, head])`); every "
        "other unit stays as given. The checker runs your function inside `build_plan`, shards "
        "the model with the result and trains it beside one process."
    ),
    stub=(
        "def group_tied_units(model, units):\n"
        '    """`units` (tuples of module names) with the units that split a tie merged into\n'
        '    one group unit each; every other unit unchanged."""\n'
    ),
    setup="from fsdp_lab.sharding.ties import find_ties\nfrom fsdp_lab.sharding.wrap import unit_name, unit_of_module",
    hints=(
        "`find_ties(model)` lists the ties; each has `.modules`, the owner of each of its names.",
        "`unit_of_module(owner, units)` is the unit name of an owner (`''`: the root); "
        "`unit_name(u)` is a unit's name (members joined by '+').",
        "For each tie whose owners' units differ: take those units out of the list and append "
        "one tuple holding all their members. Do it for every tie, not only the first.",
    ),
    solution=group_tied_units,
    trial=trial,
    judge=judge,
    cases=(
        Case(
            "2 ranks, tied GPT, embedding and head each a unit",
            2,
            {"model": "gpt", "units": ["tok_emb", "blocks.0", "blocks.1", "head"]},
        ),
        Case(
            "2 ranks, untied MLP stack: nothing to mend",
            2,
            {"model": "untied", "units": ["emb", "blocks.0", "blocks.1", "head"]},
        ),
        Case(
            "3 ranks, two ties: embedding/head and one position table read twice",
            3,
            {"model": "shared", "units": ["emb", "pos_in", "pos_out", "head"]},
        ),
    ),
    bugs=(
        Bug(
            "first-tie-only",
            "mending only the first tie",
            _first_tie_only,
            "a model with two ties keeps the second one split: build_plan refuses the plan",
        ),
        Bug(
            "move-one-owner",
            "moving one owner out of its unit",
            _move_one_owner,
            "the head leaves its unit for the root while the embedding keeps its own: the tie "
            "is still split, and the plan is refused",
        ),
        Bug(
            "keep-old-units",
            "adding the group but keeping the old units",
            _keep_old_units,
            "the tied modules are listed in two units each: the plan is refused",
        ),
        Bug(
            "to-root",
            "leaving the tied modules to the root unit",
            _to_root,
            "it trains right, but the root unit, gathered for the whole step, grows by the tied "
            "weight: the step's peak memory rises",
        ),
    ),
    points=2,
    minutes=15,
)
