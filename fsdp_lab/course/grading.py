"""`fsdp-lab grade PATH...`: grade a class's submissions headless, each file in a sandbox.

    fsdp-lab grade submitted/                 a table of per-exercise scores and verdicts
    fsdp-lab grade a.ipynb b.py --json        one JSON object: every file's verdicts
    fsdp-lab grade submitted/ --csv grades.csv    one row per submission, for the gradebook

The trust boundary: learner code runs only in the sandboxed child of its own file
(`submission`, in `sandbox`), which replies with what the learner's function did on its ranks —
plain JSON, never a pickle, never a verdict. This process, which no learner code ever runs in,
measures the reference solution on ranks of its own (once per case for the whole class), judges
each reply against it, and alone builds the rows and writes the gradebook: the student's name
comes from the path, the score from the judge. Whatever a submission does — print, exit, hang,
crash, reply garbage, delete files — it is that file's row, and grading goes on.

Which files, whose, and in what order is `roster`'s (copied before the first runs, links
refused, students in turns, a cap per student); the table and the CSV are `gradebook`'s; the
text of verdicts is kept printable. An
optional class time limit bounds the whole run. What goes wrong on the grader's side is the
grader's: a reference that cannot run stops grading with one line (`GraderError`), never a
row that blames a student; a file whose reply the grader fails on is that file's row, marked
as the grader's error, and the others go on.
"""

from __future__ import annotations

import json
import os
import re
import resource
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fsdp_lab.course import sandbox
from fsdp_lab.course.gradebook import score_line
from fsdp_lab.course.roster import (
    MAX_FILES_PER_STUDENT,
    OVER_THE_CAP,
    SnapshotError,
    Submission,
    fair_order,
    submissions,
)
from fsdp_lab.course.verdict import printable

# A file's wall clock: start-up (interpreter, torch, ranks), then the per-case limit for its
# top-level code and once per exercise it defines (a check stops at the first case that hangs).
START_ALLOWANCE = 60.0
REPLY_LIMIT = 8 << 20  # a whole class's correct reply is about 4 MB (all 15 exercises)
MAX_REPLY_LINES = 100  # a reply is a header and a line per exercise
MAX_NOTES, NOTE_CHARS = 20, 300
OPEN_FILES, MIN_OPEN_FILES = 4096, 256  # wanted, and the least a class can be graded with


class GraderError(Exception):
    """The grader cannot grade (its reference solution failed to run): nobody's submission is
    at fault, so grading stops with this one line instead of rows that blame students."""


def check_grader_environment() -> None:
    """What would make the grader's own reference fail, checked before the first file (a
    ValueError naming the fix): too few open files (the soft limit is raised to what the hard
    one allows); the ranks of grading run on the CPU, as the sandbox's do."""
    from fsdp_lab.choices import DEVICE_ENV, DEVICES

    # Open files: the reference's ranks, each sandbox's pipes and gloo's sockets. A low soft
    # limit (`ulimit -n 40`) failed inside the reference as "please report"; raise it to the
    # hard limit, which any process may, or say what to do.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES if hard == resource.RLIM_INFINITY else min(OPEN_FILES, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    if wanted < MIN_OPEN_FILES:
        raise ValueError(
            f"open files: this shell allows {hard} (ulimit -Hn), grading needs at least "
            f"{MIN_OPEN_FILES} — raise it (ulimit -n 4096, or ask your administrator)"
        )
    device = os.environ.get(DEVICE_ENV)
    if device and device not in DEVICES:
        raise ValueError(
            f"{DEVICE_ENV}={device!r} is not one of {DEVICES}; grading runs every rank on the "
            f"CPU (submissions and the reference alike) — unset {DEVICE_ENV}"
        )


def grade_paths(
    paths: Iterable[Path],
    time_limit: float,
    only: str | None = None,
    progress: Callable[[str], None] = lambda line: None,
    max_files: int = MAX_FILES_PER_STUDENT,
    class_time_limit: float | None = None,
) -> dict[str, Any]:
    """Every file's result (`submissions`, in the order graded), what the sandbox sees
    (`sandbox`) and how many files the grader itself failed on (`grader_errors`); `progress`
    gets one line per file as it is graded. A ValueError before the first file for input the
    grader cannot use; a GraderError if its reference cannot run."""
    from fsdp_lab.course.catalog import exercise

    if only is not None:
        exercise(only)  # a name that does not exist: ValueError before anything runs
    check_grader_environment()
    paths = list(paths)
    binds = sandbox.python_binds(avoid=paths) if sandbox.bwrap() is not None else []
    snapshot = tempfile.TemporaryDirectory(prefix="fsdp_lab_submissions_")  # mode 0700
    judge: Judge | None = None
    try:  # from here on, whatever ends the run (SIGTERM too) removes every copy
        try:
            listed = fair_order(submissions(paths, Path(snapshot.name), max_files))
        except SnapshotError as exc:  # the grader's own folder is full: no student's row
            raise GraderError(str(exc)) from exc
        over = OVER_THE_CAP.format(max_files)
        todo, skipped = [], []  # files to run, and rows past the cap (never copied)
        for sub in listed:
            (skipped if sub.error and sub.error.endswith(over) else todo).append(sub)
        seen = {"note": sandbox.sandbox_note(sandbox.Limits(wall_seconds=0)), "binds": binds}
        progress(seen["note"])
        if todo and any(sub.copy is not None for sub in todo):
            check_sandbox_runs(binds)  # before any student is given a row by a broken sandbox
        students = len({sub.student for sub in todo})
        mentions = [mentioned(sub) for sub in todo]  # each file read once, here
        limits = [
            file_limits(sub, len(m), time_limit, only)
            for sub, m in zip(todo, mentions, strict=True)
        ]
        budget = sum(lim.wall_seconds for lim in limits if lim is not None)
        capped = (
            f" ({len(skipped)} more over the cap of {max_files} per student)" if skipped else ""
        )
        progress(
            f"{_count(len(todo), 'file')} of {_count(students, 'student')}{capped}; each file "
            f"stops at its own time limit: {budget / 60:.0f} min at most in all"
            + (f" (class time limit {class_time_limit:g} s)" if class_time_limit else "")
        )
        judge = Judge(max(time_limit, 30.0))  # the reference's cases get at least the default
        # The reference of every exercise the class mentions, measured while the first files run.
        for name in dict.fromkeys(n for names in mentions for n in names):
            if only is None or name == only:
                judge.prepare(exercise(name))
        results, grader_errors, t_start = [], 0, time.monotonic()
        for i, (sub, lim) in enumerate(zip(todo, limits, strict=True), 1):
            t0 = time.perf_counter()
            if class_time_limit is not None and time.monotonic() - t_start > class_time_limit:
                result = {"file": sub.shown, "student": sub.student,
                          "error": f"not graded: the class time limit ({class_time_limit:g} s) "
                          "was reached first — grade this file again on its own"}  # fmt: skip
            else:
                try:
                    result = grade_one(sub, time_limit, lim, only, judge, binds)
                except (GraderError, KeyboardInterrupt):
                    raise
                except Exception as exc:  # ours, not the student's: this row, then go on
                    grader_errors += 1
                    result = {"file": sub.shown, "student": sub.student,
                              "error": f"grader error on this file (a bug in fsdp_lab, not the "
                              f"submission's fault: please report it): {printable(repr(exc))[:300]}"}  # fmt: skip
            results.append(result)
            took = time.perf_counter() - t0
            progress(f"[{i}/{len(todo)}] {sub.shown}: {score_line(result)} ({took:.0f} s)")
    finally:
        if judge is not None:
            judge.close()
        snapshot.cleanup()
    rows = results + [{"file": s.shown, "student": s.student, "error": s.error} for s in skipped]
    return {"sandbox": seen, "submissions": rows, "grader_errors": grader_errors}


# Python starts, fsdp_lab imports, torch can be found: what every submission needs first (a
# tenth of a second, where importing the course would take two).
CANARY = (
    "import importlib.util, os, fsdp_lab\n"
    "assert importlib.util.find_spec('torch'), 'torch cannot be found'\n"
    "os.write(3, b'ok')\n"
)


def check_sandbox_runs(binds: list[str]) -> None:
    """A GraderError if the sandbox cannot run Python and import fsdp_lab (a Python that needs
    variables the sandbox clears, a bind it lacks): then every file would get "no result", and
    every student a 0 for the grader's fault."""
    with tempfile.TemporaryDirectory(prefix="fsdp_lab_canary_") as folder:
        probe = Path(folder, "canary.py")
        probe.write_text(CANARY)
        run = sandbox.run_submission(
            probe, "canary.py", ["canary.py"], sandbox.Limits(wall_seconds=START_ALLOWANCE), 64,
            binds=binds,
        )  # fmt: skip
    if run.reply != b"ok":
        last = [ln for ln in run.stderr.splitlines() if ln.strip()][-3:] or ["no output"]
        raise GraderError(
            "the sandbox cannot run this Python (a file that only imports fsdp_lab failed "
            f"there, exit code {run.returncode}): {printable(' | '.join(last))[:400]}"
        )


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}" + ("" if n == 1 else "s")


def file_limits(
    sub: Submission, mentions: int, time_limit: float, only: str | None
) -> sandbox.Limits | None:
    """What `sub`'s sandbox may use: its wall clock grows with the exercises it mentions."""
    if sub.copy is None:
        return None
    checks = 1 if only else mentions
    return sandbox.Limits(wall_seconds=START_ALLOWANCE + time_limit * (1 + checks))


# `python -m fsdp_lab.course.submission FILE`, but with the ranks' fork server started first:
# `-m` imports the course package, and torch with it, before the module's first line; started
# this way, the server imports torch and every exercise beside this process (on two cores,
# seconds sooner up, on every file).
RUN_SUBMISSION = (
    "from fsdp_lab.cluster import launcher\n"
    "launcher.preload('fsdp_lab.course.catalog')\n"
    "launcher.warm_up()\n"
    "import runpy\n"
    "runpy.run_module('fsdp_lab.course.submission', run_name='__main__', alter_sys=True)\n"
)


def grade_one(
    sub: Submission, time_limit: float, limits: sandbox.Limits | None, only: str | None,
    judge: Judge, binds: list[str] | None = None,
) -> dict:  # fmt: skip
    """One file's row (`limits`: its sandbox's, `file_limits`): its verdicts, or the one error
    that stopped it."""
    row: dict[str, Any] = {"file": sub.shown, "student": sub.student}
    if sub.copy is None or limits is None:
        return {**row, "error": sub.error}
    inside = "submission" + Path(sub.name).suffix
    argv = ["-c", RUN_SUBMISSION, inside, f"--time-limit={time_limit:g}"]
    argv += [f"--name={printable(sub.name)}"]  # one argument: a name may start like an option
    run = sandbox.run_submission(
        sub.copy, inside, [*argv, *([f"--only={only}"] if only else [])], limits, REPLY_LIMIT,
        binds=binds,
    )  # fmt: skip
    return {**row, **judge.verdicts(read_reply(run), run, only, sub)}


def mentioned(sub: Submission) -> list[str]:
    """The exercises whose names appear in a submission's text (what it may define)."""
    from fsdp_lab.course.catalog import EXERCISES

    text = sub.copy.read_bytes().decode("utf-8", errors="replace") if sub.copy else ""
    return [e.name for e in EXERCISES if re.search(rf"\b{e.name}\b", text)]


def read_reply(run: sandbox.Run) -> dict[str, Any]:
    """The reply lines a submission's process wrote, gathered; what is not a JSON object of a
    known form is dropped (it can only cost the file its own grade)."""
    reply: dict[str, Any] = {"exercises": {}}
    for line in (run.reply or b"").split(b"\n", MAX_REPLY_LINES)[:MAX_REPLY_LINES]:
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
            continue
        if not isinstance(obj, dict):
            continue
        if isinstance(obj.get("error"), str) and "error" not in reply:
            reply["error"] = obj["error"][:NOTE_CHARS]
        elif isinstance(obj.get("defined"), list) and "defined" not in reply:
            reply["defined"] = [n for n in obj["defined"] if isinstance(n, str)]
            notes = obj.get("notes") if isinstance(obj.get("notes"), list) else []
            reply["notes"] = [
                printable(str(n)[:NOTE_CHARS])[:NOTE_CHARS] for n in notes[:MAX_NOTES]
            ]
        elif isinstance(obj.get("exercise"), str):
            reply["exercises"].setdefault(obj["exercise"], obj)
    return reply


def how_it_stopped(run: sandbox.Run) -> str:
    """Why a submission's process gave no (full) reply, in one line."""
    if run.limit_hit == "memory":
        return "stopped at the sandbox's memory limit (all its processes together)"
    if run.limit_hit == "processes":
        return "stopped at the sandbox's limit of processes and threads"
    if run.timed_out:
        return f"stopped at the file's time limit ({run.seconds:.0f} s)"
    if run.reply is None:
        return "its reply was larger than allowed and was not read"
    last = next((ln for ln in reversed(run.stderr.splitlines()) if ln.strip()), "no output")
    return f"the grading process ended (exit code {run.returncode}): {printable(last)[:200]}"


class Judge:
    """The grader's side: the reference solution on ranks no learner code runs on (measured on
    a thread of its own, one exercise after another, while the submissions run), and the
    verdicts made here from a submission's reply."""

    def __init__(self, time_limit: float | None = None) -> None:
        self.time_limit = time_limit  # a case's limit on the grader's ranks (replays included)
        self._pool: Any = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference")
        self._futures: dict[str, Future] = {}

    def prepare(self, ex: Any) -> Future:
        """Start measuring `ex`'s reference on every case (once)."""
        if ex.name not in self._futures:
            self._futures[ex.name] = self._worker.submit(self._measure, ex)
        return self._futures[ex.name]

    def _measure(self, ex: Any) -> dict[str, dict]:
        from fsdp_lab.course.checker import expected_run

        return {case.label: expected_run(ex, case, self._ranks()) for case in ex.cases}

    def _ranks(self) -> Any:
        from fsdp_lab.course.pool import ClusterPool

        if self._pool is None:  # on the CPU, as the sandboxed submissions run
            limit = {} if self.time_limit is None else {"time_limit": self.time_limit}
            self._pool = ClusterPool(device="cpu", **limit)
        return self._pool

    def measured(self, ex: Any, runs: list) -> Iterable[Any]:
        """A replayed exercise's runs as the grader measures them (`checker.replayed_run`, on
        the reference's thread and ranks, one case at a time as the verdict asks for it: a
        verdict stops at the first failing case); other exercises' runs as they came."""
        if not ex.replayed:
            return runs
        from fsdp_lab.course.checker import replayed_run

        self.reference(ex)  # a reference that failed: the grader's error, said first

        def replay(case: Any, run: Any) -> Any:
            return replayed_run(ex, case, run, self._ranks())

        return (
            self._worker.submit(replay, case, run).result()
            for case, run in zip(ex.cases, runs, strict=False)
        )

    def reference(self, ex: Any) -> dict[str, dict]:
        """The reference's runs of `ex`, by case (measured now if no file mentioned it); a
        GraderError if the reference itself failed."""
        future = self.prepare(ex)
        try:
            return future.result()
        except Exception as exc:
            raise GraderError(
                f"the grader's reference for {ex.name} could not run: {printable(str(exc))[:500]}"
            ) from exc

    def expected(self, ex: Any) -> Callable[[Any], list]:
        return lambda case: self.reference(ex)[case.label]["outcomes"]

    def verdicts(
        self, reply: dict[str, Any], run: sandbox.Run, only: str | None, sub: Submission
    ) -> dict[str, Any]:
        from fsdp_lab.course.catalog import EXERCISES, LABS, exercise
        from fsdp_lab.course.checker import signature_verdict, verdict_of
        from fsdp_lab.course.verdict import Verdict

        if "error" in reply:  # what its process said: never taken for the grader's own words
            return {
                "error": f"the submission's process said: {printable(reply['error'])}"[:NOTE_CHARS]
            }
        if "defined" not in reply:
            return {"error": f"{printable(sub.name)}: no result — {how_it_stopped(run)}"}
        defined = set(reply["defined"])
        notes = list(reply["notes"])
        labs = [lab for lab, group in LABS.items() if any(e.name in defined for e in group)]
        if not labs:
            names = ", ".join(e.name for e in EXERCISES)
            return {
                "error": f"{printable(sub.name)}: defines none of the exercise functions ({names})",
                "notes": notes,
            }
        if only is not None and only not in defined:
            why = f"no function {only} in the file (--only {only})"
            return {"verdicts": [Verdict(only, "missing", why, exercise(only).points).to_dict()],
                    "notes": notes}  # fmt: skip
        verdicts = []
        stopped = False
        for ex in (e for lab in labs for e in LABS[lab]):
            if only is not None and ex.name != only:
                continue
            report = reply["exercises"].get(ex.name)
            if ex.name not in defined:
                v = Verdict(ex.name, "missing", f"no function {ex.name} in the file", ex.points)
            elif isinstance(report, dict) and "wrong_signature" in report:
                v = signature_verdict(ex, report["wrong_signature"])
            else:
                runs = report.get("runs") if isinstance(report, dict) else None
                stopped = stopped or not isinstance(runs, list)
                runs = self.measured(ex, runs[: len(ex.cases)] if isinstance(runs, list) else [])
                v = verdict_of(ex, runs, self.expected(ex))
            verdicts.append(v.to_dict())
        if stopped:
            notes.append(how_it_stopped(run))
        return {"verdicts": verdicts, "notes": notes}

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
        if self._pool is not None:
            self._pool.close()
