"""Checking a learner's function: signature, then each case on live ranks, then one verdict.

    grade(exercise, fn, pool)  -> Verdict            (no output: for tests and `fsdp-lab grade`)
    check(exercise, fn, pool)  -> None, shows the verdict; raises ExerciseFailed if not passed

Each case is one `cluster.run`: every rank runs the exercise's trial, which puts the learner's
function into the real mechanism and the reference solution into a second copy, and returns what
it measured; the exercise's judge compares the two in the notebook. The first failing case is
the verdict. What can go wrong on the ranks is told apart from what `Cluster` reports:

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
import os
import sys
from collections.abc import Callable
from typing import Any

from fsdp_lab.cluster import RankError
from fsdp_lab.cluster.driver import how_it_ended
from fsdp_lab.exercises.exercise import Case, Exercise, Mismatch
from fsdp_lab.exercises.on_rank import HINT_MARK, attempt
from fsdp_lab.exercises.pool import ClusterPool
from fsdp_lab.exercises.verdict import ExerciseFailed, Verdict

DUMP_SHARE = 0.8  # a hung rank writes its stack at this share of the time limit
MAX_TRACEBACK_LINES = 30


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


def grade(exercise: Exercise, fn: Any, pool: ClusterPool | None = None) -> Verdict:
    """Check `fn` against `exercise` on every case; the verdict of the first that fails."""
    problem = signature_problem(exercise, fn)
    if problem is not None:
        return Verdict(
            exercise.name,
            "wrong signature",
            problem,
            exercise.points,
            hint="Keep the stub's first line (def ...) as it was given; write only the body.",
        )
    own = pool is None
    pool = pool or ClusterPool()
    passed: list[str] = []
    try:
        for case in exercise.cases:
            verdict = _one_case(exercise, fn, case, pool, passed)
            if verdict is not None:
                return verdict
            passed.append(case.label)
    finally:
        if own:
            pool.close()
    return Verdict(
        exercise.name,
        "passed",
        f"Matches the reference in all {len(passed)} cases: " + "; ".join(passed) + ".",
        exercise.points,
        passed_cases=passed,
    )


def _one_case(
    exercise: Exercise, fn: Any, case: Case, pool: ClusterPool, passed: list[str]
) -> Verdict | None:
    def verdict(kind: str, summary: str, **more: Any) -> Verdict:
        return Verdict(
            exercise.name,
            kind,
            summary,
            exercise.points,
            case=case.label,
            passed_cases=list(passed),
            **more,
        )

    cluster = pool.cluster(case.world_size)
    stack_file = os.path.join(pool.stack_dir, f"{exercise.name}.rank{{rank}}.stack")
    try:
        outcomes = cluster.run(
            attempt,
            exercise.trial,
            fn,
            exercise.solution,
            case,
            stack_file,
            pool.time_limit * DUMP_SHARE,
        )
    except RankError as exc:
        return _rank_failure(exc, exercise, fn, stack_file, case, verdict)
    mismatch = exercise.judge(outcomes, case)
    if mismatch is None:
        return None
    return _wrong_result(mismatch, verdict)


def _wrong_result(mismatch: Mismatch, verdict: Callable[..., Verdict]) -> Verdict:
    return verdict(
        "wrong result",
        mismatch.summary,
        rows=mismatch.rows,
        hint=mismatch.hint,
        series=mismatch.series,
    )


def _rank_failure(
    exc: RankError,
    exercise: Exercise,
    fn: Any,
    stack_file: str,
    case: Case,
    verdict: Callable[..., Verdict],
) -> Verdict:
    where = _code_file(fn)
    if exc.exitcode is not None:
        return verdict(
            "died",
            f"rank {exc.rank}'s process ended ({how_it_ended(exc.exitcode)}) while running "
            "your function.",
            rank=exc.rank,
            hint="A process dies from os._exit/sys.exit, a signal, or running out of memory: "
            "look for one of those in your function.",
        )
    if exc.remote_traceback:
        tb = _cut(exc.remote_traceback, where)
        last = exc.remote_traceback.strip().splitlines()[-1]
        if "WrongOutput:" in last:
            what, _, hint = last.split("WrongOutput:", 1)[1].strip().partition(HINT_MARK)
            return verdict(
                "wrong output",
                what,
                rank=exc.rank,
                hint=hint or "Return what the docstring says: same shape and dtype as described.",
            )
        if last.startswith("NotImplementedError"):
            return verdict(
                "not implemented",
                "the function still raises NotImplementedError: write its body.",
                rank=exc.rank,
                hint="Replace `raise NotImplementedError()` with your code.",
            )
        return verdict(
            "raised",
            f"your function raised on rank {exc.rank}: {last}",
            rank=exc.rank,
            traceback=tb,
            hint="Read the last lines of the traceback: the line of your code that raised.",
        )
    rank, stack, waiting = _hung_rank(exc.rank, case.world_size, stack_file, where)
    also = ("; " + ", ".join(waiting)) if waiting else ""
    return verdict(
        "hung",
        f"rank {rank} did not finish within the time limit{also}. The check stopped every "
        "rank; fresh ones serve the next attempt.",
        rank=rank,
        traceback=stack,
        hint=exercise.hang_hint
        or "A collective that not every rank calls (inside `if rank() == ...`), or with "
        "different sizes on different ranks, waits forever; so does a loop that never ends.",
    )


def _code_file(fn: Any) -> str | None:
    code = getattr(fn, "__code__", None)
    return code.co_filename if code is not None else None


def _cut(tb: str, where: str | None) -> str:
    """The traceback from the learner's first frame on (ours before it is noise to them)."""
    lines = tb.rstrip().splitlines()
    if where:
        for i, line in enumerate(lines):
            if line.strip().startswith(f'File "{where}"'):
                lines = ["Traceback (most recent call last):", *lines[i:]]
                break
    if len(lines) > MAX_TRACEBACK_LINES:
        lines = ["...", *lines[-MAX_TRACEBACK_LINES:]]
    return "\n".join(lines)


def _hung_rank(
    reported: int, world_size: int, stack_file: str, where: str | None
) -> tuple[int, str, list[str]]:
    """The rank stuck in the learner's own code (else the one `Cluster` reported), its stack,
    and one line per other rank that was waiting in a collective (for it, most likely)."""
    stacks = {r: _main_thread(_read(stack_file.format(rank=r))) for r in range(world_size)}
    frames = {
        r: [ln.strip() for ln in s.splitlines() if ln.strip().startswith("File ")]
        for r, s in stacks.items()
    }

    def in_own_code(r: int) -> bool:  # the most recent frame is the learner's
        return bool(where and frames[r] and frames[r][0].startswith(f'File "{where}"'))

    own = [r for r in stacks if in_own_code(r)]
    rank = own[0] if own else reported
    waiting = []
    for r, fr in frames.items():
        if r != rank and fr and "torch/distributed" in fr[0]:
            waiting.append(f"rank {r} was waiting in {fr[0].rsplit(' in ', 1)[-1]}")
    stack = ""
    if stacks.get(rank):
        stack = f"stack of rank {rank} just before the time limit (most recent call first):\n"
        stack += stacks[rank]
    return rank, stack, waiting


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _main_thread(dump: str) -> str:
    """faulthandler's block for the thread that ran the trial, cut after `attempt` (below it:
    the rank's own machinery)."""
    for block in dump.split("\n\n"):
        if "in attempt" in block:
            lines = [ln for ln in block.splitlines() if not ln.startswith("Timeout (")]
            end = next(i for i, ln in enumerate(lines) if ln.rstrip().endswith("in attempt"))
            return "\n".join(lines[:end]).strip()
    return ""


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
