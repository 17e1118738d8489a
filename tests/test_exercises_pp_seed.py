"""The pp-seed lab's exercises: the reference passes every case (stage seeds on even and uneven
splits; the hand-over on even, uneven, head-first and pp x dp layouts, equal to the one-process
init), each classic bug fails with the hint that names it and the measured symptom beside the
reference; a wrong seeds tensor stops every rank before the broadcast, and the mechanism's own
guard does the same when it is called directly."""

from __future__ import annotations

import pytest
import torch

import fsdp_lab
from fsdp_lab import RankError, course
from fsdp_lab.pipeline.exercises import hand_over as pp_seed_handover
from fsdp_lab.pipeline.exercises import stage_seeds as pp_seed
from fsdp_lab.pipeline.model import PipeGPTConfig
from fsdp_lab.pipeline.rng import per_stage_seed
from fsdp_lab.pipeline.stages import stage_info


@pytest.mark.parametrize("exercise", [pp_seed.STAGE_SEEDS, pp_seed_handover.HAND_OVER])
def test_the_reference_passes_every_case(exercise_pool, exercise):
    v = course.grade(exercise.name, exercise.solution, exercise_pool)
    assert v.passed, v.to_text()
    assert v.passed_cases == [c.label for c in exercise.cases]


def _cells(v, row: int) -> tuple[str, str]:
    return v.rows[row][1], v.rows[row][2]  # expected, got


def test_same_seed_repeats_stage_0s_numbers_on_stage_1(exercise_pool):
    v = course.grade("stage_seeds", pp_seed.STAGE_SEEDS.bug("same-seed").wrong, exercise_pool)
    assert v.kind == "wrong result" and v.case.startswith("2 stages"), v.to_text()
    assert "every stage got the same seed" in v.hint
    (exp0, got0), (exp1, got1) = _cells(v, 0), _cells(v, 1)
    assert got0 == got1 and exp0 != exp1  # yours: stage 1 = stage 0; the reference's differ
    lines = v.series["lines"]
    assert lines["yours, stage 0"] == lines["yours, stage 1"] != lines["reference, stage 1"]


def test_seed_plus_stage_makes_neighbouring_runs_share_a_stage(exercise_pool):
    bug = pp_seed.STAGE_SEEDS.bug("seed-plus-stage")
    v = course.grade("stage_seeds", bug.wrong, exercise_pool)
    assert v.kind == "wrong result" and v.case.startswith("2 stages"), v.to_text()
    assert "seed + stage" in v.hint and "seed 8 draws on stage 0" in v.summary
    (exp_a, got_a), (exp_b, got_b) = _cells(v, 0), _cells(v, 1)
    assert got_a == got_b and exp_a != exp_b
    assert v.series is not None


def test_seeds_from_the_global_rng_are_not_reproducible(exercise_pool):
    v = course.grade("stage_seeds", pp_seed.STAGE_SEEDS.bug("global-rng").wrong, exercise_pool)
    assert v.kind == "wrong result" and v.case.startswith("2 stages"), v.to_text()
    assert "global RNG" in v.hint
    (exp1, got1), (exp2, got2) = _cells(v, 0), _cells(v, 1)
    assert exp1 == exp2 and got1 != got2  # the reference is the same twice; yours is not
    assert len(v.series["lines"]) == 3


def _as_list(seed, stages):
    return [seed] * stages


def test_a_list_of_seeds_is_wrong_output_on_every_rank_before_the_broadcast(exercise_pool):
    v = course.grade("stage_seeds", _as_list, exercise_pool)
    assert v.kind == "wrong output", v.to_text()
    assert "expected a torch.Tensor of shape (2,), got list" in v.summary


@pytest.mark.parametrize(
    ("slug", "hint", "messages"),
    [
        ("restart", "each stage restarts the stream", "0"),
        ("before-drawing", "the one from before the stage drew", "2"),
    ],
)
def test_hand_over_bugs_that_repeat_a_stage(exercise_pool, slug, hint, messages):
    bug = pp_seed_handover.HAND_OVER.bug(slug)
    v = course.grade("hand_over", bug.wrong, exercise_pool)
    assert v.kind == "wrong result" and v.case.startswith("2 stages"), v.to_text()
    assert hint in v.hint
    (exp0, got0), (exp1, got1) = _cells(v, 0), _cells(v, 1)
    assert exp0 == got0  # stage 0 drew right; stage 1 repeats it, one process does not
    assert got1 == got0 and exp1 != exp0
    assert v.rows[2][0].startswith("sends + recvs") and _cells(v, 2) == ("2", messages)
    assert v.series is not None


def test_a_state_received_but_never_set(exercise_pool):
    bug = pp_seed_handover.HAND_OVER.bug("not-set")
    v = course.grade("hand_over", bug.wrong, exercise_pool)
    assert v.kind == "wrong result" and v.case.startswith("2 stages"), v.to_text()
    assert "set_generator_state" in v.hint and v.summary.startswith("stage 1")
    expected, got = _cells(v, 0)
    assert expected != got and _cells(v, 1) == ("2", "2")


# -- the mechanism's guard: per_stage_seed called directly with a bad draw --------------------


def _float_seeds(seed, stages):
    return torch.rand(stages)


def _seed_with(draw):
    cfg = PipeGPTConfig(vocab_size=16, dim=8, n_layers=2, n_heads=2, seq_len=4)
    info = stage_info(fsdp_lab.rank(), fsdp_lab.world_size(), 2, cfg.n_layers)
    per_stage_seed(cfg, info, 0, stage_seeds=draw)


def test_a_bad_draw_fails_every_rank_none_left_waiting(exercise_pool):
    cluster = exercise_pool.cluster(2)
    with pytest.raises(RankError) as err:
        cluster.run(_seed_with, _float_seeds)
    text = str(err.value)
    assert "must be an integer tensor of shape (2,)" in text  # rank 0's, whichever came first
    assert "did not answer" not in text  # rank 1 raised too, it did not wait
    assert cluster.run(fsdp_lab.rank) == [0, 1]  # every rank answered: the cluster is kept
