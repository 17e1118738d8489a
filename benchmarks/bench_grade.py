"""`fsdp-lab grade` on a class of correct submissions: seconds per file, this checkout beside
another (the version before a change), interleaved.

    python benchmarks/bench_grade.py [--files 3] [--repeats 5] [--lab LAB] [--against DIR]

A class of `--files` copies of one correct submission (every exercise's reference solution, or
one lab's with `--lab`) is graded by `python -m fsdp_lab grade` as a whole process; a file's
time is the command's wall time over the number of files (the class shares the grader's
reference ranks, as a real class does). With `--against DIR` (a checkout of another version,
e.g. `git worktree add ../before <commit>`), the same command with that checkout first on
PYTHONPATH runs after each of ours, and each pair's ratio is printed; quote the medians. The
machine's load average is printed at the start and the end: a noisy machine widens the spread.

No assertion: a benchmark reports, tests assert behaviour.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def submission(lab: str | None) -> str:
    """A correct submission: the reference solution under each exercise's name."""
    from fsdp_lab.course import EXERCISES

    names = [e.name for e in EXERCISES if lab is None or e.lab == lab]
    if not names:
        raise SystemExit(
            f"--lab {lab!r}: no exercises (labs: {sorted({e.lab for e in EXERCISES})})"
        )
    lines = ["from fsdp_lab.course import exercise as _exercise", ""]
    lines += [f'{name} = _exercise("{name}").solution' for name in names]
    return "\n".join(lines) + "\n"


def grade_seconds(folder: Path, files: int, pythonpath: str | None) -> tuple[float, int]:
    """Wall seconds per file of grading `folder`, and the points given (a sanity check)."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_lab", "grade", str(folder), "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder.parent,
    )
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"grading failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    results = json.loads(proc.stdout)["submissions"]
    points = sum(v["score"] for r in results for v in r.get("verdicts", []))
    return seconds / files, points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=3, help="submissions in the class")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lab", default=None, help="one lab's exercises only")
    parser.add_argument("--against", default=None, help="another checkout to compare with")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_grade_") as tmp:
        folder = Path(tmp) / "submitted"
        text = submission(args.lab)
        for i in range(args.files):
            (folder / f"student{i}").mkdir(parents=True)
            (folder / f"student{i}" / "answers.py").write_text(text)
        print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
        print(f"a class of {args.files} correct submissions, {args.repeats} repeats, interleaved")
        ours, theirs, points = [], [], set()
        for _ in range(args.repeats):
            seconds, got = grade_seconds(folder, args.files, None)
            ours.append(seconds)
            points.add(got)
            if args.against:
                seconds, got = grade_seconds(folder, args.files, args.against)
                theirs.append(seconds)
                points.add(got)
        print(f"points given per run: {sorted(points)} (the same in every run, or something broke)")
        print("| grader | s per file, median | min | max |")
        print("|---|---|---|---|")
        for name, times in (("this checkout", ours), (args.against, theirs)):
            if times:
                med = statistics.median(times)
                print(f"| {name} | {med:.1f} | {min(times):.1f} | {max(times):.1f} |")
        if theirs:
            ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
            print(
                f"this checkout / {args.against}: median {statistics.median(ratios):.2f} "
                f"(pairs {min(ratios):.2f}-{max(ratios):.2f})"
            )
        print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
