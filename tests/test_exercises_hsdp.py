"""The hsdp lab's exercise, run inside the real hybrid sharding: the reference passes a 2x2 and
a 1x2 mesh; each classic bug fails with its own hint, on the mesh that exposes it."""

from __future__ import annotations

import pytest

from fsdp_lab import exercises
from fsdp_lab.exercises import hsdp


def test_the_reference_passes_every_case(exercise_pool):
    v = exercises.grade("hsdp_reduce_grad", hsdp.hsdp_reduce_grad, exercise_pool)
    assert v.passed, v.to_text()
    assert len(v.passed_cases) == len(hsdp.HSDP_REDUCE_GRAD.cases)


@pytest.mark.parametrize(
    ("slug", "case", "summary", "hint"),
    [
        (
            "no-replica-all-reduce",
            "4 ranks",
            "the replicas drifted apart",
            "across replicate_group",
        ),
        ("shard-group-size", "4 ranks", "drifts from it", "÷ the shard group's size (2)"),
        ("whole-gradient", "4 ranks", "values right, but rank 0 sent 2x", "not the whole gradient"),
        ("group-none", "2 ranks as a 1x2", "drifts from it", "group=None means every rank"),
    ],
)
def test_each_bug_fails_with_its_own_hint(exercise_pool, slug, case, summary, hint):
    bug = hsdp.HSDP_REDUCE_GRAD.bug(slug)
    v = exercises.grade("hsdp_reduce_grad", bug.wrong, exercise_pool)
    assert v.kind == "wrong result" and v.score == 0, v.to_text()
    assert v.case.startswith(case) and summary in v.summary and hint in v.hint, v.to_text()
