"""The tying lab's exercises: the reference passes every case, each classic bug fails with the
hint that names it; and the mechanism's injection points (`build_plan`'s ``split_ties=`` and
``mend_ties=``) behave as the exercises rely on."""

from __future__ import annotations

import pytest

from fsdp_lab import course
from fsdp_lab.sharding.wrap import PlanError, build_plan, group_tied_units
from fsdp_lab.tying.exercises import EXERCISES, tied_models
from fsdp_lab.tying.exercises import group_tied_units as tying_mend
from fsdp_lab.tying.exercises import split_ties as tying


def test_a_check_that_misses_a_split_tie_gives_each_unit_its_own_copy():
    model = tied_models.build("gpt")
    with pytest.raises(PlanError, match="'tok_emb.weight'"):
        build_plan(model, ["tok_emb", "head"])  # the reference check refuses
    plan = build_plan(model, ["tok_emb", "head"], split_ties=lambda m, unit_of: [])
    assert [r.name for r in plan.params["tok_emb"]] == ["tok_emb.weight"]
    assert [r.owners for r in plan.params["head"]] == [(("head", "weight"),)]
    # shard() resolves the plan again: with the check it was built with, not the reference's.
    assert build_plan(model, plan) == plan


def test_group_tied_units_merges_only_the_units_a_tie_splits():
    model = tied_models.build("shared")
    units = [("emb",), ("pos_in",), ("first",), ("pos_out",), ("head",)]
    mended = group_tied_units(model, units)
    # `first` shares its Linear with `second`, which is in the root unit: the root takes it.
    assert {frozenset(u) for u in mended} == {
        frozenset({"emb", "head"}),
        frozenset({"pos_in", "pos_out"}),
    }
    plan = build_plan(model, [*units, ("second",)], mend_ties=group_tied_units)
    assert set(plan.units) == {"", "first+second", "pos_in+pos_out", "emb+head"}


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.name)
def test_the_reference_passes_every_case(exercise_pool, exercise):
    v = course.grade(exercise.name, exercise.solution, exercise_pool)
    assert v.passed, v.to_text()
    assert len(v.passed_cases) == len(exercise.cases)


@pytest.mark.parametrize(
    ("slug", "case", "hint", "series"),
    [
        (
            "by-name",
            "3 ranks, tied GPT, embedding and head in different",
            "by Parameter object",
            True,
        ),
        ("shared-module", "2 ranks, three kinds of tie", "one module registered in two", True),
        (
            "every-tie",
            "2 ranks, tied GPT, embedding and head in one unit",
            "inside one unit",
            False,
        ),
    ],
)
def test_each_split_ties_bug_fails_with_its_own_hint(exercise_pool, slug, case, hint, series):
    v = course.grade("split_ties", tying.SPLIT_TIES.bug(slug).wrong, exercise_pool)
    assert v.kind == "wrong result" and v.score == 0
    assert v.case.startswith(case) and hint in v.hint, v.to_text()
    if series:  # the plan was sharded: the loss left one-process training, each copy drifted
        lines = v.series["lines"]
        assert len(lines["yours (plan sharded)"]) == tied_models.STEPS
        assert lines["yours (plan sharded)"] != lines["one process (tied)"]
        gap = dict((r[0], r[2]) for r in v.rows)
        assert float(next(g for w, g in gap.items() if w.startswith("largest gap"))) > 0


@pytest.mark.parametrize(
    ("slug", "case", "hint"),
    [
        ("first-tie-only", "3 ranks, two ties", "mend every tie"),
        ("move-one-owner", "2 ranks, tied GPT", "Moving one owner"),
        ("keep-old-units", "2 ranks, tied GPT", "kept the owners' old units"),
        ("to-root", "2 ranks, tied GPT", "group the owners into one unit"),
    ],
)
def test_each_group_tied_units_bug_fails_with_its_own_hint(exercise_pool, slug, case, hint):
    v = course.grade("group_tied_units", tying_mend.GROUP_TIED_UNITS.bug(slug).wrong, exercise_pool)
    assert v.kind == "wrong result" and v.score == 0
    assert v.case.startswith(case) and hint in v.hint, v.to_text()
    if slug == "to-root":  # right values, a larger root unit and a higher measured peak
        rows = {r[0]: (r[1], r[2]) for r in v.rows}
        expected_root, got_root = map(int, rows["elements in the root unit"])
        assert got_root > expected_root
        expected_peak, got_peak = map(int, rows["peak memory of the steps (bytes, measured)"])
        assert got_peak > expected_peak
        assert v.series is not None and v.series["bytes"]
