"""Checking a learner's function: signature, then each case on live ranks, then one verdict.

    grade(exercise, fn, pool)  -> Verdict            (no output: for tests and the gallery)
    check(exercise, fn, pool)  -> None, shows the verdict; raises ExerciseFailed if not passed

A case is two runs of the exercise's trial on live ranks, kept apart: the learner's function
(`run_case`) and the reference solution (`expected_outcomes`, cached in the pool: the reference
gives the same values every time). Each run returns plain data; the exercise's judge compares
them. `fsdp-lab grade` makes the two runs in different processes — the learner's in a sandbox
(`learner_runs`, whose JSON is all that comes back), the reference's in the grader's own ranks —
and `verdict_of` turns what came back into a verdict there. What can go wrong on the learner's
ranks is told apart from what `Cluster` reports:

- a rank raised: its traceback, cut to start at the learner's own code when it is in there;
  `WrongOutput` (type/shape/dtype, `on_rank.expect_tensor`) and `NotImplementedError` (the stub
  is still there) get their own kinds;
- a rank did not answer within the pool's time limit: "hung", with the stack `faulthandler`
  wrote on that rank just before the limit (the rank whose stack is in the learner's code);
- a rank process died: its exit code or signal.

After a hang or a death `Cluster` has stopped the ranks and starts fresh ones on the next run,
so the next attempt (or the next submission) gets a working cluster.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from fsdp_lab.cluster import RankError
from fsdp_lab.cluster.driver import how_it_ended
from fsdp_lab.course import frames
from fsdp_lab.course.pool import ClusterPool
from fsdp_lab.course.verdict import ExerciseFailed, Verdict, printable
from fsdp_lab.exercise import HINT_MARK, Case, Exercise, Impossible, Replay, attempt

DUMP_SHARE = 0.8  # a hung rank writes its stack at this share of the time limit
# What a learner's run may say about itself: each kind is a failed verdict. "passed" and
# "wrong result" are never taken from a learner's process: only the judge gives them.
FAILURE_KINDS = ("raised", "hung", "died", "wrong output", "not implemented", "invalid reply")
TEXT_LIMITS = {"summary": 2_000, "hint": 1_000, "traceback": 12_000}
MAX_DEPTH = 12  # the deepest a trial's outcome nests (dicts of lists of pairs of lists ...)


def signature_problem(exercise: Exercise, fn: Any) -> str | None:
    """Why `fn` cannot be called the way the mechanism calls the solution, or None."""
    wanted = inspect.signature(exercise.solution)
    names = ", ".join(wanted.parameters)
    if not callable(fn):
        return f"expected a function {exercise.name}({names}), got {type(fn).__name__} {fn!r:.60}"
    try:
        got = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin or C function: let the call decide
    try:
        got.bind(*wanted.parameters)
    except TypeError:
        return (
            f"{exercise.name} is called as {exercise.name}({names}); yours takes "
            f"({', '.join(str(p) for p in got.parameters.values())})"
        )
    return None


def signature_verdict(exercise: Exercise, problem: str) -> Verdict:
    return Verdict(
        exercise.name,
        "wrong signature",
        printable(str(problem)[: TEXT_LIMITS["summary"]]),
        exercise.points,
        hint="Keep the stub's first line (def ...) as it was given; write only the body.",
    )


def grade(exercise: Exercise, fn: Any, pool: ClusterPool | None = None) -> Verdict:
    """Check `fn` against `exercise` on every case; the verdict of the first that fails."""
    problem = signature_problem(exercise, fn)
    if problem is not None:
        return signature_verdict(exercise, problem)
    own = pool is None
    pool = pool or ClusterPool()
    try:
        for case in exercise.cases:  # the reference first, on ranks the learner's code has not run
            expected_outcomes(exercise, case, pool)
        return verdict_of(
            exercise,
            learner_runs(exercise, fn, pool),
            lambda case: expected_outcomes(exercise, case, pool),
        )
    finally:
        if own:
            pool.close()


def learner_runs(exercise: Exercise, fn: Any, pool: ClusterPool) -> Iterator[dict[str, Any]]:
    """`fn`'s run of each case, in order, up to the first that fails on the ranks."""
    for case in exercise.cases:
        run = run_case(exercise, fn, case, pool)
        yield run
        if "failure" in run:
            return


def run_case(exercise: Exercise, fn: Any, case: Case, pool: ClusterPool) -> dict[str, Any]:
    """One trial of `fn` on the case's ranks: {"outcomes": [per-rank data]} (and, for a replayed
    exercise, "answers": per rank, every call of `fn` as [arguments, answer]) or {"failure":
    {kind, summary, rank, traceback, hint}} when a rank raised, hung or died."""
    cluster = pool.cluster(case.world_size)
    stack_file = os.path.join(pool.stack_dir, f"{exercise.name}.rank{{rank}}.stack")
    record = exercise.replayed and not isinstance(fn, Replay)
    try:
        texts = cluster.run(
            attempt, exercise.trial, fn, case, stack_file, pool.time_limit * DUMP_SHARE, record
        )
    except RankError as exc:
        return {"failure": _rank_failure(exc, exercise, fn, stack_file, case)}
    try:
        replies = [json.loads(t) for t in texts]
        run = {"outcomes": [r["outcome"] for r in replies]}
    except (TypeError, ValueError, KeyError) as exc:  # `attempt` itself was replaced on a rank
        return {"failure": {"kind": "invalid reply", "summary": f"the ranks replied {exc!r}"}}
    if record:
        run["answers"] = [r.get("answers") for r in replies]
    return run


def expected_run(exercise: Exercise, case: Case, pool: ClusterPool) -> dict[str, Any]:
    """The reference solution's run of `case`: its per-rank outcomes (and answers, for a
    replayed exercise), measured once per pool, then cached."""
    key = (exercise.name, case.label)
    if key not in pool.expected:
        run = run_case(exercise, exercise.solution, case, pool)
        if "failure" in run:
            raise RuntimeError(
                f"the reference solution of {exercise.name} failed on case {case.label!r}: "
                f"{run['failure']['summary']}\n{run['failure'].get('traceback', '')}"
            )
        pool.expected[key] = run
    return pool.expected[key]


def expected_outcomes(exercise: Exercise, case: Case, pool: ClusterPool) -> list[Any]:
    """The reference solution's per-rank outcomes on `case` (run once per pool, then cached)."""
    return expected_run(exercise, case, pool)["outcomes"]


MAX_ANSWERS = 10_000  # calls per rank a replayed reply may hold (a trial makes a few dozen)


def replayed_run(exercise: Exercise, case: Case, run: Any, pool: ClusterPool) -> Any:
    """For a replayed exercise, the learner's `run` as the grader measures it: its answers
    replayed in the mechanism on `pool`'s ranks (or, when they are the reference's answers,
    the reference's outcomes: the same answers give the same run). A failure the learner's
    ranks reported stays as it was; answers of the wrong form are an "invalid reply"."""
    if not exercise.replayed or not isinstance(run, dict) or "failure" in run:
        return run
    answers = run.get("answers")
    if not _answer_lists(answers, case.world_size):
        return {"failure": {"kind": "invalid reply", "summary": "the reply holds no answers of "
                            "the form a recorded run gives"}}  # fmt: skip
    reference = expected_run(exercise, case, pool)
    if answers == reference.get("answers"):
        return {"outcomes": reference["outcomes"]}
    replay = run_case(exercise, Replay(answers), case, pool)
    failure = replay.get("failure")
    if failure is not None and "ReplayMismatch" in failure.get("traceback", ""):
        return {"failure": {"kind": "invalid reply", "summary": "the reply's answers are not "
                            "what the exercise asks: they were not recorded by a run"}}  # fmt: skip
    return replay


def _answer_lists(answers: Any, world_size: int) -> bool:
    return (
        isinstance(answers, list)
        and len(answers) == world_size
        and all(isinstance(mine, list) and len(mine) <= MAX_ANSWERS for mine in answers)
        and all(isinstance(a, list) and len(a) == 2 for mine in answers for a in mine)
        and _shallow(answers, MAX_DEPTH)
    )


def verdict_of(
    exercise: Exercise, runs: Iterable[Any], expected: Callable[[Case], list[Any]]
) -> Verdict:
    """The verdict of the learner's `runs` (in case order, as `learner_runs` yields them, maybe
    read back from a learner's process: anything malformed is that exercise's failure), each
    judged against `expected(case)`."""
    passed: list[str] = []
    runs = iter(runs)
    for case in exercise.cases:
        verdict = _case_verdict(exercise, case, next(runs, None), expected, passed)
        if verdict is not None:
            return verdict
        passed.append(case.label)
    return Verdict(
        exercise.name,
        "passed",
        f"Matches the reference in all {len(passed)} cases: " + "; ".join(passed) + ".",
        exercise.points,
        passed_cases=passed,
    )


def _case_verdict(
    exercise: Exercise,
    case: Case,
    run: Any,
    expected: Callable[[Case], list[Any]],
    passed: list[str],
) -> Verdict | None:
    def verdict(kind: str, summary: str, **more: Any) -> Verdict:
        # Every text may carry what a learner's code chose (a name, a message): printable.
        if "rows" in more:
            more["rows"] = [tuple(printable(str(c)) for c in row) for row in more["rows"]]
        for key in ("hint", "traceback"):
            if key in more:
                more[key] = printable(str(more[key]), keep_newlines=key == "traceback")
        return Verdict(
            exercise.name,
            kind,
            printable(str(summary)),
            exercise.points,
            case=case.label,
            passed_cases=list(passed),
            **more,
        )

    if run is None:
        return verdict(
            "no result",
            "the grading process ended before this case was run (time limit, exit or crash).",
        )
    if not isinstance(run, dict):
        return verdict("invalid reply", f"a case's run is a {type(run).__name__}, not a dict")
    if "failure" in run:
        return _reported(run["failure"], verdict)
    outcomes = run.get("outcomes")
    if not isinstance(outcomes, list) or len(outcomes) != case.world_size:
        return verdict("invalid reply", f"expected one outcome per rank ({case.world_size})")
    if not _shallow(outcomes, MAX_DEPTH):
        return verdict("invalid reply", f"the outcomes nest deeper than {MAX_DEPTH} levels")
    reference = expected(case)  # outside the try: a reference that fails is the grader's error
    try:
        mismatch = exercise.judge(outcomes, reference, case)
    except Impossible as exc:
        return verdict("invalid reply", f"an impossible measurement — {exc}")
    except Exception as exc:  # whatever judging the learner's data raises is that data's fault
        return verdict("invalid reply", f"the ranks' outcomes cannot be judged ({exc!r:.200})")
    if mismatch is None:
        return None
    return verdict(
        "wrong result",
        mismatch.summary,
        rows=mismatch.rows,
        hint=mismatch.hint,
        series=mismatch.series,
    )


def _shallow(data: Any, limit: int) -> bool:
    """No list or dict in `data` nests deeper than `limit` (walked without recursion)."""
    todo = [(data, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict | list):
            if depth >= limit:
                return False
            todo += [(x, depth + 1) for x in (item.values() if isinstance(item, dict) else item)]
    return True


def _reported(failure: Any, verdict: Callable[..., Verdict]) -> Verdict:
    """A failure a learner's run reported about itself, as a verdict: only a failing kind, only
    strings of bounded length, only an int rank."""
    if not isinstance(failure, dict) or failure.get("kind") not in FAILURE_KINDS:
        return verdict("invalid reply", "a failure of an unknown kind was reported")
    texts = {key: str(failure.get(key) or "")[:limit] for key, limit in TEXT_LIMITS.items()}
    rank = failure.get("rank")
    rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else None
    return verdict(
        failure["kind"],
        texts["summary"],
        rank=rank,
        hint=texts["hint"],
        traceback=texts["traceback"],
    )


def _rank_failure(
    exc: RankError, exercise: Exercise, fn: Any, stack_file: str, case: Case
) -> dict[str, Any]:
    """What went wrong on the ranks, as a failure record (kind, summary, rank, traceback, hint)."""
    files = frames.learner_files(fn)

    def failure(kind: str, summary: str, hint: str, traceback: str = "", rank: int = exc.rank):
        return {"kind": kind, "summary": summary, "hint": hint, "traceback": traceback,
                "rank": rank}  # fmt: skip

    if exc.exitcode is not None:
        return failure(
            "died",
            f"rank {exc.rank}'s process ended ({how_it_ended(exc.exitcode)}) while running "
            "your function.",
            "A process dies from os._exit/sys.exit, a signal, or running out of memory: "
            "look for one of those in your function.",
        )
    if exc.remote_traceback:
        last = exc.remote_traceback.strip().splitlines()[-1]
        if "WrongOutput:" in last:
            what, _, hint = last.split("WrongOutput:", 1)[1].strip().partition(HINT_MARK)
            return failure(
                "wrong output",
                what,
                hint or "Return what the docstring says: same shape and dtype as described.",
            )
        if last.startswith("NotImplementedError"):
            return failure(
                "not implemented",
                "the function still raises NotImplementedError: write its body.",
                "Replace `raise NotImplementedError()` with your code.",
            )
        return failure(
            "raised",
            f"your function raised on rank {exc.rank}: {last}",
            "Read the last lines of the traceback: the line of your code that raised.",
            traceback=frames.cut(exc.remote_traceback, files),
        )
    rank, stack, waiting = frames.hung_rank(exc.rank, case.world_size, stack_file, files)
    also = ("; " + ", ".join(waiting)) if waiting else ""
    return failure(
        "hung",
        f"rank {rank} did not finish within the time limit{also}. The check stopped every "
        "rank; fresh ones serve the next attempt.",
        exercise.hang_hint
        or "A collective that not every rank calls (inside `if rank() == ...`), or with "
        "different sizes on different ranks, waits forever; so does a loop that never ends.",
        traceback=stack,
        rank=rank,
    )


def show(verdict: Verdict) -> None:
    """The verdict in a notebook (Markdown, and its curves drawn), or as text on a terminal."""
    shell = sys.modules.get("IPython")
    ipython = shell.get_ipython() if shell is not None else None
    if ipython is None or not hasattr(ipython, "kernel"):
        print(verdict.to_text())
        return
    from IPython.display import Markdown, display

    display(Markdown(verdict.to_markdown()))
    if verdict.series is not None:
        from fsdp_lab.plots import plot_expected_got

        display_figure(plot_expected_got(verdict.series))


def display_figure(fig: Any) -> None:
    """Show a matplotlib Figure as a PNG: built without pyplot, it has no inline display of its
    own until something in the kernel has imported pyplot's inline backend."""
    import io

    from IPython.display import Image, display

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=fig.dpi)
    display(Image(data=buffer.getvalue(), format="png"))


def check(exercise: Exercise, fn: Any, pool: ClusterPool | None = None) -> None:
    """Grade `fn`, show the verdict; raise ExerciseFailed (an AssertionError) if it failed."""
    verdict = grade(exercise, fn, pool)
    show(verdict)
    if not verdict.passed:
        raise ExerciseFailed(verdict)
