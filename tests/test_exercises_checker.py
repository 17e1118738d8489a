"""The autograder itself: what a learner sees when the function raises on one rank, hangs,
returns the wrong shape, keeps the stub, or has the wrong signature — and that the ranks survive
for the next attempt, with no process left behind."""

from __future__ import annotations

import linecache
import os
import time

import psutil
import pytest

from fsdp_lab import comm, course, rank
from fsdp_lab.collectives.exercises import all_reduce_mean as collectives
from fsdp_lab.course.verdict import ExerciseFailed


def raises_on_rank_1(tensor, group):
    if rank() == 1:
        raise ValueError("boom on rank 1")
    out = tensor.clone()
    comm.all_reduce(out, group=group)
    return out / 2


def hangs_on_rank_1(tensor, group):
    if rank() == 1:
        while True:
            time.sleep(0.05)
    out = tensor.clone()
    comm.all_reduce(out, group=group)
    return out / 2


def exits_on_rank_1(tensor, group):
    if rank() == 1:
        os._exit(3)
    return tensor


def flattens(tensor, group):
    return tensor.reshape(-1)


def stub(tensor, group):
    raise NotImplementedError()


def one_argument(tensor):
    return tensor


@pytest.fixture(scope="module")
def short_pool():
    with course.ClusterPool(time_limit=5) as pool:
        yield pool


def test_a_raise_on_one_rank_names_the_rank_and_shows_the_learners_traceback(short_pool):
    v = course.grade("all_reduce_mean", raises_on_rank_1, short_pool)
    assert (v.kind, v.rank, v.score) == ("raised", 1, 0)
    assert "ValueError: boom on rank 1" in v.summary
    # The traceback starts at the learner's own code, and ends with the error.
    assert v.traceback.splitlines()[1].strip().startswith(f'File "{__file__}"')
    assert "in raises_on_rank_1" in v.traceback and "fsdp_lab/cluster" not in v.traceback


def _cell(source: str, number: int) -> dict:
    """What a notebook cell defines: a kernel compiles each cell under a made-up file name (no
    file: its lines live in the kernel's linecache only) and a rank cannot show them."""
    name = f"/tmp/ipykernel_{os.getpid()}/{number}.py"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    namespace = {"comm": comm, "rank": rank}
    exec(compile(source, name, "exec"), namespace)
    return namespace


RAISES_IN_A_HELPER = """\
def helper(t):
    raise ValueError("my own mistake")
"""
CALLS_THE_HELPER = """\
def all_reduce_mean(tensor, group):
    out = tensor.clone()
    helper(out)
    return out
"""
WAITS_ON_RANK_0_ONLY = """\
def all_reduce_mean(tensor, group):
    out = tensor.clone()
    if rank() == 0:
        comm.all_reduce(out, group=group)
    return out / 2
"""


def test_a_notebook_cells_code_is_said_as_your_cell_with_its_lines_first(short_pool):
    """Issue 39: a verdict showed the learner's code by the kernel's made-up file name, without
    its line, among the package's frames. Their frames come first, as "your cell, line N" with
    the line itself, from whichever cell each function came from."""
    fn = _cell(CALLS_THE_HELPER, 2)["all_reduce_mean"]
    fn.__globals__["helper"] = _cell(RAISES_IN_A_HELPER, 1)["helper"]
    v = course.grade("all_reduce_mean", fn, short_pool)
    assert v.kind == "raised"
    assert v.traceback.splitlines()[:5] == [
        "Traceback (most recent call last):",
        "  your cell, line 3, in all_reduce_mean",
        "    helper(out)",
        "  your cell, line 2, in helper",
        '    raise ValueError("my own mistake")',
    ]
    hung = course.grade(
        "all_reduce_mean", _cell(WAITS_ON_RANK_0_ONLY, 3)["all_reduce_mean"], short_pool
    )
    assert hung.kind == "hung"
    lines = hung.traceback.splitlines()
    assert lines[1:4] == [
        "your code, most recent call first:",
        "  your cell, line 4, in all_reduce_mean",
        "    comm.all_reduce(out, group=group)",
    ], hung.traceback
    assert "ipykernel_" not in hung.traceback  # in the whole stack below too


def test_a_hang_on_one_rank_is_reported_with_its_stack_and_the_ranks_come_back(short_pool):
    before = short_pool.cluster(2).pids  # the ranks the hang is on (the first case's)
    v = course.grade("all_reduce_mean", hangs_on_rank_1, short_pool)
    assert (v.kind, v.rank) == ("hung", 1)
    assert "rank 0 was waiting in all_reduce" in v.summary
    assert "in hangs_on_rank_1" in v.traceback.splitlines()[2]  # the stuck line, first
    assert not [
        p for p in before if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
    ]
    # The next attempt runs on fresh ranks and passes.
    assert course.grade("all_reduce_mean", collectives.all_reduce_mean, short_pool).passed


def test_a_rank_that_exits_is_reported_with_its_exit_code(short_pool):
    v = course.grade("all_reduce_mean", exits_on_rank_1, short_pool)
    assert (v.kind, v.rank, v.score) == ("died", 1, 0)
    assert "rank 1's process ended (exit code 3)" in v.summary, v.to_text()


@pytest.mark.parametrize(
    ("fn", "kind", "words"),
    [
        (flattens, "wrong output", "expected shape (4, 5), got (20,)"),
        (stub, "not implemented", "NotImplementedError"),
        (one_argument, "wrong signature", "all_reduce_mean(tensor, group); yours takes (tensor)"),
        (42, "wrong signature", "expected a function all_reduce_mean(tensor, group), got int"),
    ],
)
def test_each_kind_of_broken_function_gets_its_own_verdict(short_pool, fn, kind, words):
    v = course.grade("all_reduce_mean", fn, short_pool)
    assert v.kind == kind and v.score == 0 and words in v.summary + v.traceback, v.to_text()
    assert v.hint


def test_check_prints_the_verdict_and_raises_an_assertion_for_nbgrader(short_pool, capsys):
    course.check_all_reduce_mean(collectives.all_reduce_mean, short_pool)
    assert "✓ all_reduce_mean: passed (2 of 2 points)" in capsys.readouterr().out
    with pytest.raises(AssertionError) as failed:
        course.check_all_reduce_mean(collectives.ALL_REDUCE_MEAN.bug("sum").wrong, short_pool)
    assert isinstance(failed.value, ExerciseFailed)
    shown = capsys.readouterr().out
    assert "✗ all_reduce_mean: wrong result" in shown and "hint: SUM where" in shown
    assert failed.value._render_traceback_() == [
        "ExerciseFailed: " + failed.value.verdict.headline() + " — the verdict above says why."
    ]


def test_an_exercise_that_does_not_exist_is_named_with_the_closest(short_pool):
    with pytest.raises(
        ValueError, match="'all_reduce_mena' does not exist: did you mean 'all_reduce_mean'"
    ):
        course.grade("all_reduce_mena", collectives.all_reduce_mean, short_pool)


def test_closing_the_pool_leaves_no_rank_behind():
    with course.ClusterPool(time_limit=5) as pool:
        assert course.grade("all_reduce_mean", collectives.all_reduce_mean, pool).passed
        pids = pool.pids
        assert len(pids) == 2 + 3
    time.sleep(0.5)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_a_wrong_result_names_an_exact_multiple_and_only_an_exact_one():
    from fsdp_lab.exercise import multiple

    assert multiple([2.0, 4.0, -6.0], [1.0, 2.0, -3.0]) == " (2× the reference's)"
    assert multiple([2.0, 4.0, -5.0], [1.0, 2.0, -3.0]) == ""  # correlated, not a multiple
    assert multiple([1.0, 2.0], [1.0, 2.0]) == ""


# -- replayed exercises: the grader measures what a learner's answers do (issue 35, point 2) -----

REPLAYED = [e for e in __import__("fsdp_lab.course.catalog", fromlist=["EXERCISES"]).EXERCISES
            if e.replayed]  # fmt: skip


def test_the_exercises_whose_answers_are_plain_data_are_replayed():
    assert {e.name for e in REPLAYED} == {
        "unit_to_prefetch", "sqrt_segment_starts", "mesh_groups", "stage_seeds"
    }  # fmt: skip


@pytest.mark.parametrize("exercise", REPLAYED, ids=lambda e: e.name)
def test_a_replayed_bug_gets_the_verdict_it_gets_on_the_learners_own_ranks(short_pool, exercise):
    """Every classic bug, its answers recorded on the learner's ranks and replayed on the
    grader's: the same verdict kind, and the figures the grader shows are the grader's."""
    from fsdp_lab.course.checker import learner_runs, replayed_run, verdict_of

    def expected(case):
        return __import__("fsdp_lab.course.checker", fromlist=["x"]).expected_outcomes(
            exercise, case, short_pool
        )

    for bug in exercise.bugs:
        runs = list(learner_runs(exercise, bug.wrong, short_pool))
        own = verdict_of(exercise, runs, expected)
        forged = [{**r, "outcomes": "forged"} if "outcomes" in r else r for r in runs]
        replayed = verdict_of(
            exercise,
            (replayed_run(exercise, c, r, short_pool) for c, r in zip(exercise.cases, forged, strict=False)),
            expected,
        )  # fmt: skip
        assert (replayed.kind, replayed.case) == (own.kind, own.case), bug.slug
        assert own.kind != "passed"
    runs = list(learner_runs(exercise, exercise.solution, short_pool))
    replayed = (
        replayed_run(exercise, c, r, short_pool) for c, r in zip(exercise.cases, runs, strict=False)
    )
    assert verdict_of(exercise, replayed, expected).passed


def test_answers_no_run_recorded_are_an_invalid_reply(short_pool):
    from fsdp_lab.course.catalog import exercise
    from fsdp_lab.course.checker import learner_runs, replayed_run

    ex = exercise("sqrt_segment_starts")
    (case, *_) = ex.cases
    (run, *_) = learner_runs(ex, ex.solution, short_pool)
    asked = [[[[case.params["layers"] + 1], [0, 3]]]] * case.world_size  # another question
    for answers in (asked, "x", [[]] * case.world_size, [[["a"]]] * case.world_size):
        got = replayed_run(ex, case, {**run, "answers": answers}, short_pool)
        assert got["failure"]["kind"] == "invalid reply", answers


def test_a_verdict_cell_with_no_values_says_so():
    """Issue 39: `fsdp-lab bugs` printed "... | with the bug " and nothing, for a run that left
    no gradient to show."""
    from fsdp_lab.exercise import first_values

    assert first_values([]) == "none"
    assert first_values([1.0, 2.5, 3.25, 4.0]) == "1, 2.5, 3.25"
