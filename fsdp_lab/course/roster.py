"""The class to grade: which files, whose, copied where, and in what order.

Every file is copied into the grader's private folder before the first one runs (a submission
cannot change or delete another's), links are refused (a link can name another student's file,
or anything the grader may read), and names are kept printable. Students are graded in turns —
every student's first file, then every student's second, ... — at most `MAX_FILES_PER_STUDENT`
each, so one student's thousand files cannot hold up the class.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fsdp_lab.course.submission import SUFFIXES
from fsdp_lab.course.verdict import printable

MAX_FILE_BYTES = 16 << 20  # a submission larger than this is refused unread
MAX_FILES_PER_STUDENT = 10


@dataclass(frozen=True)
class Submission:
    """One file to grade: how it is shown, whose it is, its copy made before grading began (in
    the grader's private folder; or why it cannot be graded)."""

    shown: str
    student: str
    name: str
    copy: Path | None = None
    error: str | None = None


def submissions(paths: Iterable[Path], snapshot: Path) -> list[Submission]:
    """The files to grade, in order, each copied now into `snapshot` (a folder only the grader
    can read). Folders are searched recursively (without following links) for files; the
    student is the first folder below the one given, as in nbgrader's
    submitted/<student>/<assignment>/, else the file's name. A path that gives nothing to grade
    is a Submission with its error."""
    found: list[Submission] = []
    paths = list(paths)
    # Several folders named (`submitted/*`): a student is named with the folder it came from,
    # or every student's "ps1/" would be one student "ps1".
    named = sum(_is_folder(p) for p in paths) > 1
    for path in paths:
        shown = printable(str(path))
        try:
            is_folder = path.is_dir() and not path.is_symlink()
        except OSError as exc:  # a name longer than the system allows, ...
            found.append(Submission(shown, "", path.name, error=f"{shown}: {exc.strerror}"))
            continue
        if is_folder:
            files = sorted(_walk(path))
            if not files:
                found.append(Submission(shown, "", path.name, error=f"{shown}: no files in it"))
            for p in files:
                rel = p.relative_to(path)
                student = rel.parts[0] if len(rel.parts) > 1 else p.stem
                student = f"{path.name}/{student}" if named else student
                found.append(_read(p, printable(student), snapshot / str(len(found))))
        elif path.exists() or path.is_symlink():
            found.append(_read(path, printable(path.stem), snapshot / str(len(found))))
        else:
            found.append(Submission(shown, "", path.name, error=f"{shown}: no such file or folder"))
    return found


def _is_folder(path: Path) -> bool:
    try:
        return path.is_dir() and not path.is_symlink()
    except OSError:  # a name longer than the system allows: its row says so below
        return False


HIDDEN = (".", "__")  # .ipynb_checkpoints/, __pycache__/: Jupyter's and Python's, not a student's


def _walk(folder: Path) -> Iterable[Path]:
    for root, dirs, files in os.walk(folder):  # links to folders are listed, never followed
        dirs[:] = [d for d in dirs if not d.startswith(HIDDEN)]
        for name in [*files, *(d for d in dirs if os.path.islink(os.path.join(root, d)))]:
            if not name.startswith(HIDDEN) or name.endswith(SUFFIXES):  # a hidden .py: a row
                yield Path(root, name)


def _read(path: Path, student: str, copy: Path) -> Submission:
    """`path` copied to `copy`, or why it is not graded: a link (its target may be another
    student's file, or anything the grader can read), a file of another kind, too large, or
    unreadable."""
    shown = printable(str(path))

    def refused(why: str) -> Submission:
        return Submission(shown, student, path.name, error=f"{shown}: {why}")

    try:
        if path.name.startswith(HIDDEN):
            return refused(f"a hidden file (its name starts with {path.name[:2]!r}) — not "
                           "graded; rename it")  # fmt: skip
        if path.is_symlink():
            return refused("a symbolic link — refused (submit the file itself)")
        if path.suffix not in SUFFIXES:
            return Submission(
                shown, student, path.name,
                error=f"{printable(path.name)}: not a notebook (.ipynb) or Python file (.py) — "
                "nothing graded",
            )  # fmt: skip
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            return refused("not a regular file — nothing graded")
        if info.st_nlink > 1:
            return refused("a hard link to another file — refused (submit the file itself)")
        if info.st_size > MAX_FILE_BYTES:
            return refused(f"larger than {MAX_FILE_BYTES >> 20} MiB — not graded")
        with path.open("rb") as f, copy.open("wb") as out:
            out.write(f.read(MAX_FILE_BYTES + 1)[:MAX_FILE_BYTES])
    except (OSError, RuntimeError) as exc:  # RuntimeError: a link loop, on some Pythons
        return refused(f"cannot be read ({printable(str(exc))[:200]})")
    return Submission(shown, student, path.name, copy=copy)


def fair_order(todo: list[Submission], max_files: int) -> tuple[list[Submission], list[dict]]:
    """Every student's first file, then every student's second, ... (one student's thousand
    files cannot hold up the class); past `max_files` a student's files get a row each that
    says they were not graded."""
    by_student: dict[str, list[Submission]] = {}
    for sub in todo:
        by_student.setdefault(sub.student or sub.shown, []).append(sub)
    rounds = max((len(subs) for subs in by_student.values()), default=0)
    ordered = [subs[k] for k in range(min(rounds, max_files)) for subs in by_student.values()
               if k < len(subs)]  # fmt: skip
    skipped = [
        {"file": sub.shown, "student": sub.student,
         "error": f"not graded: more than {max_files} files per student (--max-files-per-student)"}
        for subs in by_student.values() for sub in subs[max_files:]
    ]  # fmt: skip
    return ordered, skipped
