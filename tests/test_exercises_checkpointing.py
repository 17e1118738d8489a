"""The checkpointing lab's exercises: the reference passes every case, each classic bug fails
with the hint that names it, on live ranks inside fsdp_lab's own checkpoint and executor."""

from __future__ import annotations

import math

import pytest

from fsdp_lab import course, theory
from fsdp_lab.checkpointing import schedules
from fsdp_lab.checkpointing.exercises import rerun_with_forward_rng as checkpointing
from fsdp_lab.checkpointing.exercises import sqrt_segment_starts as checkpoint_segments
from fsdp_lab.checkpointing.recompute import rerun_with_forward_rng


def test_both_exercises_are_listed_for_the_lab():
    names = [e.name for e in course.LABS["checkpoint"]]
    assert names == ["rerun_with_forward_rng", "sqrt_segment_starts"]
    assert checkpointing.RERUN_WITH_FORWARD_RNG.solution is rerun_with_forward_rng  # injected


@pytest.mark.parametrize("name", ["rerun_with_forward_rng", "sqrt_segment_starts"])
def test_the_reference_passes_every_case(exercise_pool, name):
    ex = course.exercise(name)
    v = course.grade(name, ex.solution, exercise_pool)
    assert v.passed, v.to_text()
    assert len(v.passed_cases) == len(ex.cases)


@pytest.mark.parametrize(
    ("slug", "summary", "hint"),
    [
        ("no-restore", "step 1's gradients differ", "drew new dropout masks"),
        ("no-put-back", "the gradients are right", "Put the generator back after run()"),
    ],
)
def test_each_rng_bug_fails_with_its_own_hint(exercise_pool, slug, summary, hint):
    bug = checkpointing.RERUN_WITH_FORWARD_RNG.bug(slug)
    v = course.grade("rerun_with_forward_rng", bug.wrong, exercise_pool)
    assert v.kind == "wrong result" and v.score == 0, v.to_text()
    assert v.case.startswith("2 ranks") and summary in v.summary and hint in v.hint, v.to_text()
    rows = {what: (exp, got) for what, exp, got in v.rows}
    step1_loss = rows["loss at step 1 (the forward)"]
    assert step1_loss[0] == step1_loss[1]  # the forward is untouched by either bug...
    grads = rows["step-1 gradient, first 3 values"]
    assert (grads[0] == grads[1]) == (slug == "no-put-back")  # ...only no-restore's backward
    draws = rows["next 3 random numbers after step 1"]
    assert draws[0] != draws[1]  # both leave the generator elsewhere than store-all does
    losses = v.series["lines"]["yours"]
    assert len(losses) == checkpointing.STEPS
    assert losses[0] == v.series["lines"]["store-all (no checkpoint)"][0]
    assert losses[-1] != v.series["lines"]["store-all (no checkpoint)"][-1]  # training drifted


def test_a_rerun_step_that_never_runs_is_told_so(exercise_pool):
    def forgets_to_run(run, rng_at_forward, cuda_devices):
        return None

    v = course.grade("rerun_with_forward_rng", forgets_to_run, exercise_pool)
    assert v.kind == "raised" and "must call `run()`" in v.summary, v.to_text()


@pytest.mark.parametrize(
    ("slug", "hint"),
    [("every-layer", "Every layer is its own segment"), ("one-segment", "One segment over")],
)
def test_segment_bugs_take_more_measured_memory_or_calls_than_sqrt(exercise_pool, slug, hint):
    bug = checkpoint_segments.SQRT_SEGMENT_STARTS.bug(slug)
    v = course.grade("sqrt_segment_starts", bug.wrong, exercise_pool)
    assert v.kind == "wrong result" and v.case.startswith("2 ranks, 9 layers"), v.to_text()
    assert hint in v.hint, v.to_text()
    rows = {what: (exp, got) for what, exp, got in v.rows}
    n, k = 9, 3
    predicted = theory.checkpoint_cost(schedules.segments(k), n)
    # The reference's counts are the theory's; the bug's are measured, not declared.
    assert rows["kept layer inputs (counted)"][0].startswith(
        f"{predicted.stored_activations} (theory {predicted.stored_activations})"
    )
    assert rows["layer calls (counted)"][0] == (
        f"{predicted.forward_calls} (theory {predicted.forward_calls})"
    )
    # Both extremes keep all N layer inputs at some point: every one, or the rerun's.
    assert rows["kept layer inputs (counted)"][1] == str(n)
    lines = v.series["lines"]
    reference, yours, store_all = (max(line) for line in lines.values())
    assert v.series["bytes"] and reference < yours <= store_all  # the measured curves
    if slug == "one-segment":
        assert yours == store_all  # the rerun holds every activation at once


def test_segment_ends_are_refused_as_off_by_one(exercise_pool):
    bug = checkpoint_segments.SQRT_SEGMENT_STARTS.bug("segment-ends")
    v = course.grade("sqrt_segment_starts", bug.wrong, exercise_pool)
    assert v.kind == "wrong result" and v.case.startswith("2 ranks, 9 layers"), v.to_text()
    assert "the first must be 0" in v.summary and "Off by one segment" in v.hint, v.to_text()


def test_a_range_is_accepted_and_anything_else_is_named(exercise_pool):
    def as_range(n_layers):
        return range(0, n_layers, round(math.sqrt(n_layers)))

    assert course.grade("sqrt_segment_starts", as_range, exercise_pool).passed
    v = course.grade("sqrt_segment_starts", lambda n_layers: n_layers // 3, exercise_pool)
    assert v.kind == "wrong result" and "expected a list of ints, got int 3" in v.summary
