"""The collectives lab's exercises: the reference passes every case, each classic bug fails
with the hint that names it."""

from __future__ import annotations

import pytest

from fsdp_lab import exercises
from fsdp_lab.exercises import collectives


def test_the_reference_passes_every_case(exercise_pool):
    v = exercises.grade("all_reduce_mean", collectives.all_reduce_mean, exercise_pool)
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
    v = exercises.grade("all_reduce_mean", bug.wrong, exercise_pool)
    assert v.kind == "wrong result" and v.score == 0
    assert v.case.startswith(case) and hint in v.hint, v.to_text()
    assert v.series is not None and len(v.series["lines"]["yours"]) == collectives.STEPS
