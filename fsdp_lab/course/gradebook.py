"""What grading leaves: the table on the terminal and the gradebook CSV.

The gradebook is the one file grading writes, into a folder the grader chose: it replaces
whatever is at its name only if that is a file of the grader's (never a link, never another
user's file), only in a folder nobody else may rename files in, and it is written new and whole
(`fsdp_lab.outputs.write_file`). A cell that a spreadsheet would take for a formula is quoted.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from fsdp_lab.course.verdict import rows_text
from fsdp_lab.outputs import write_file


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
                f"  {mark} {v['exercise']:<24} {v['score']} of {v['points']} points  "
                f"{v['kind']}{where}"
            )
            if not v["passed"]:
                lines.append(f"      {v['summary']}")
                lines += rows_text(v.get("rows") or [], "      ")
                if v.get("hint"):
                    lines.append(f"      hint: {v['hint']}")
        for note in r.get("notes", []):
            lines.append(f"  note: {note}")
    return "\n".join(lines)


def check_destination(path: Path) -> str | None:
    """Why `path` cannot take the gradebook (checked before any file is graded), or None.

    The gradebook replaces what is at `path` (a file of the grader's) and nothing else: not a
    link (a system's /dev/stdout, or one a student planted), not another user's file; and only
    in a folder nobody else may rename files in — there anyone could swap the finished
    gradebook for their own."""
    where = f"--csv {path}"
    if path.is_dir():
        return f"{where}: is a folder; expected a file name (e.g. {path}/grades.csv)"
    parent = path.parent
    if not parent.is_dir():
        return f"{where}: the folder {parent} does not exist; create it first"
    folder = parent.stat()
    if folder.st_mode & 0o022 and not folder.st_mode & stat.S_ISVTX:
        return (f"{where}: its folder {parent} may be written by other users (mode "
                f"{stat.filemode(folder.st_mode)}, no sticky bit): anyone could replace the "
                "gradebook; choose a folder only you can write")  # fmt: skip
    with contextlib.suppress(FileNotFoundError):
        info = path.lstat()  # what sits there now is replaced, never written through
        if stat.S_ISLNK(info.st_mode):
            return f"{where}: is a symbolic link; name the file itself"
        if not stat.S_ISREG(info.st_mode):
            return f"{where}: is not a regular file; choose another name"
        if info.st_uid != os.geteuid():
            return f"{where}: belongs to user {info.st_uid}; choose another name"
    try:  # permissions, read-only mounts, /dev/fd and /proc: try it
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{path.name}.", suffix=".tmp"):
            pass
    except OSError as exc:
        return (
            f"{where}: cannot write there ({exc.strerror or exc}); choose a folder you can write to"
        )
    return None


def cell(value: Any) -> Any:
    """A CSV cell a spreadsheet shows as text: one starting like a formula gets a quote first."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def write_csv(results: list[dict[str, Any]], path: Path) -> None:
    """One row per submission: file, student, each exercise's score, total, max, and the error
    for files that could not be graded. Written once, whole, new and the grader's own
    (`outputs.write_file`: never through a link or into a file someone else put there)."""
    names: list[str] = []
    for r in results:
        for v in r.get("verdicts", []):
            if v["exercise"] not in names:
                names.append(v["exercise"])
    text = io.StringIO(newline="")
    out = csv.writer(text)
    out.writerow(["file", "student", *names, "total", "max", "error"])
    for r in results:
        scores = {v["exercise"]: v["score"] for v in r.get("verdicts", [])}
        points = sum(v["points"] for v in r.get("verdicts", []))
        row = [r["file"], r.get("student", ""), *[scores.get(n, "") for n in names]]
        out.writerow([cell(c) for c in [*row, sum(scores.values()), points, r.get("error", "")]])
    write_file(path, text.getvalue())
