"""The collectives lab's exercises: the reference passes every case, each classic bug fails
with the hint that names it."""

from __future__ import annotations

import pytest

from fsdp_lab import course
from fsdp_lab.collectives.exercises import EXERCISES
from fsdp_lab.collectives.exercises import all_reduce_mean as collectives
from fsdp_lab.collectives.exercises import gather_shards as collectives_gather


def test_the_reference_passes_every_case(exercise_pool):
    v = course.grade("all_reduce_mean", collectives.all_reduce_mean, exercise_pool)
    assert v.passed, v.to_text()
    assert len(v.passed_cases) == len(collectives.ALL_REDUCE_MEAN.cases)


@pytest.mark.parametrize(
    ("slug", "case", "hint"),
    [
        ("sum", "2 ranks", "SUM where the average was meant"),
        ("world-size", "ranks 0 and 2 of 3", "divided by the world size"),
    ],
)
def test_each_bug_fails_with_its_own_hint(exercise_pool, slug, case, hint):
    bug = collectives.ALL_REDUCE_MEAN.bug(slug)
    v = course.grade("all_reduce_mean", bug.wrong, exercise_pool)
    assert v.kind == "wrong result" and v.score == 0
    assert v.case.startswith(case) and hint in v.hint, v.to_text()
    assert v.series is not None and len(v.series["lines"]["yours"]) == collectives.STEPS


# -- gather_shards: all-gather a padded flat parameter's shards, rebuild the model ---------------


def test_gather_shards_reference_rebuilds_the_model_in_every_case(exercise_pool):
    v = course.grade("gather_shards", collectives_gather.gather_shards, exercise_pool)
    assert v.passed, v.to_text()
    assert len(v.passed_cases) == len(collectives_gather.GATHER_SHARDS.cases)
    assert collectives_gather.GATHER_SHARDS in EXERCISES


@pytest.mark.parametrize("case", collectives_gather.GATHER_SHARDS.cases, ids=lambda c: c.label)
def test_gather_shards_case_labels_tell_the_true_sizes(case):
    """The labels promise sizes (and padding) the learner reads: they are the mechanism's."""
    from fsdp_lab.sharding.flat_param import FlatParameter

    model = collectives_gather._model(case.params["width"], case.params["out"])
    names, params = zip(*model.named_parameters(), strict=True)
    shards = len(case.params.get("group") or range(case.world_size))
    flat = FlatParameter(list(names), list(params), 0, shards)
    padding = f"{flat.padding} padding" if flat.padding else "no padding"
    assert f"{flat.numel} elements in {shards} shards of {flat.shard_numel} ({padding})" in (
        case.label
    )


def test_gather_shards_without_stripping_is_a_wrong_shape_on_the_first_padded_case(
    exercise_pool,
):
    v = course.grade("gather_shards", collectives_gather._no_strip, exercise_pool)
    assert v.kind == "wrong output" and v.score == 0, v.to_text()
    assert v.case.startswith("3 ranks") and v.passed_cases[0].startswith("2 ranks")
    assert "expected shape (34,), got (36,)" in v.summary and "padding stripped" in v.summary


@pytest.mark.parametrize(
    ("slug", "case", "hint"),
    [
        ("own-shard-first", "2 ranks", "out of rank order"),
        ("strip-front", "3 ranks", "the padding sits at the END"),
    ],
)
def test_gather_shards_bugs_fail_with_their_own_hint(exercise_pool, slug, case, hint):
    bug = collectives_gather.GATHER_SHARDS.bug(slug)
    v = course.grade("gather_shards", bug.wrong, exercise_pool)
    assert v.kind == "wrong result" and v.score == 0
    assert v.case.startswith(case) and hint in v.hint, v.to_text()
    rows = {what: (exp, got) for what, exp, got in v.rows}
    assert rows["forward output, first 3"][0] != rows["forward output, first 3"][1]
