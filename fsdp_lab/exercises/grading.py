"""`fsdp-lab grade PATH...`: grade a class's submissions headless, one process per file.

    fsdp-lab grade submitted/                 a table of per-exercise scores and verdicts
    fsdp-lab grade a.ipynb b.py --json        one JSON object: every file's verdicts
    fsdp-lab grade submitted/ --csv grades.csv    one row per submission, for the gradebook

Each file is graded by `python -m fsdp_lab.exercises.submission FILE` in its own process
group, under a time limit: a submission that hangs, exits or crashes costs only itself (its
process group is killed, ranks included), and grading goes on with the next file. Bad input is
a one-line verdict for that file, never the end of the run: a file that is not a notebook or
Python file, a notebook that cannot be parsed, a folder with no submissions.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fsdp_lab.exercises.submission import BadSubmission, code_cells

# Starting a grading process and its ranks takes seconds (torch imports): a file gets this
# much on top of the per-case limit times the number of cases it could run.
START_ALLOWANCE = 60.0


def submissions(paths: Iterable[Path]) -> tuple[list[tuple[Path, str]], list[dict[str, Any]]]:
    """The files to grade, each with its student (folders are searched recursively for
    notebooks and .py files; under a folder, the student is the first folder below it, as in
    nbgrader's submitted/<student>/<assignment>/, else the file's name), and a one-line result
    per path that gives nothing to grade."""
    files: list[tuple[Path, str]] = []
    empty: list[dict[str, Any]] = []
    for path in paths:
        if path.is_dir():
            found = sorted(
                p
                for p in path.rglob("*")
                if p.is_file()
                and not any(part.startswith((".", "__")) for part in p.relative_to(path).parts)
            )
            if not found:
                empty.append({"file": str(path), "error": f"{path}: no files in it"})
            for p in found:
                rel = p.relative_to(path)
                files.append((p, rel.parts[0] if len(rel.parts) > 1 else p.stem))
        elif path.exists():
            files.append((path, path.stem))  # any suffix: the grader says what is wrong with it
        else:
            empty.append({"file": str(path), "error": f"{path}: no such file or folder"})
    return files, empty


def grade_in_process(path: Path, time_limit: float, only: str | None, budget: float) -> dict:
    """Grade `path` in a child process of its own; its JSON, or a one-line error."""
    try:  # a wrong kind of file, or a notebook that does not parse: said at once, no process
        code_cells(path)
    except BadSubmission as exc:
        return {"file": str(path), "error": str(exc)}
    cmd = [sys.executable, "-m", "fsdp_lab.exercises.submission", str(path)]
    cmd += ["--time-limit", str(time_limit)] + (["--only", only] if only else [])
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: killed whole, ranks included
    )
    try:
        out, err = proc.communicate(timeout=budget)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {
            "file": str(path),
            "error": f"{path.name}: grading took over {budget:g} s "
            "(the submission's own code ran too long?) — stopped",
        }
    except BaseException:  # Ctrl-C: no grading process is left behind
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        last = (err.strip().splitlines() or ["no output"])[-1]
        return {
            "file": str(path),
            "error": f"{path.name}: the grading process failed "
            f"(exit {proc.returncode}): {last[:200]}",
        }
    return json.loads(lines[-1])


def grade_paths(
    paths: Iterable[Path],
    time_limit: float,
    only: str | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> list[dict[str, Any]]:
    """Every file's result, in order; `progress` gets one line per file as it is graded."""
    from fsdp_lab.exercises.catalog import EXERCISES, exercise

    if only is not None:
        exercise(only)  # a name that does not exist: ValueError before anything runs
    files, results = submissions(paths)
    for line in results:
        progress(f"  {line['error']}")
    most_cases = max(len(e.cases) for e in EXERCISES) * len(EXERCISES)
    budget = START_ALLOWANCE + time_limit * most_cases
    for i, (path, student) in enumerate(files, 1):
        t0 = time.perf_counter()
        result = {"student": student, **grade_in_process(path, time_limit, only, budget)}
        results.append(result)
        progress(
            f"[{i}/{len(files)}] {path}: {score_line(result)} ({time.perf_counter() - t0:.0f} s)"
        )
    return results


def score_line(result: dict[str, Any]) -> str:
    if "error" in result:
        return result["error"]
    got = sum(v["score"] for v in result["verdicts"])
    of = sum(v["points"] for v in result["verdicts"])
    return f"{got}/{of} points"


def text_report(results: list[dict[str, Any]]) -> str:
    """A table: one block per file, one line per exercise (headline, then its one-line why)."""
    lines = []
    for r in results:
        who = f" ({r['student']})" if r.get("student") else ""
        lines.append(f"{r['file']}{who}: {score_line(r)}")
        for v in r.get("verdicts", []):
            mark = "✓" if v["passed"] else "✗"
            where = f" [{v['case']}]" if v.get("case") else ""
            lines.append(
                f"  {mark} {v['exercise']:<24} {v['score']}/{v['points']}  {v['kind']}{where}"
            )
            if not v["passed"]:
                lines.append(f"      {v['summary']}")
                if v.get("hint"):
                    lines.append(f"      hint: {v['hint']}")
        for note in r.get("notes", []):
            lines.append(f"  note: {note}")
    return "\n".join(lines)


def write_csv(results: list[dict[str, Any]], path: Path) -> None:
    """One row per submission: file, student, each exercise's score, total, max,
    and the error for files that could not be graded."""
    names: list[str] = []
    for r in results:
        for v in r.get("verdicts", []):
            if v["exercise"] not in names:
                names.append(v["exercise"])
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["file", "student", *names, "total", "max", "error"])
        for r in results:
            scores = {v["exercise"]: v["score"] for v in r.get("verdicts", [])}
            points = sum(v["points"] for v in r.get("verdicts", []))
            out.writerow(
                [
                    r["file"],
                    r.get("student", ""),
                    *[scores.get(n, "") for n in names],
                    sum(scores.values()),
                    points,
                    r.get("error", ""),
                ]
            )
