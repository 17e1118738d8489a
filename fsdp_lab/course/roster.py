"""The class to grade: which files, whose, copied where, and in what order.

[Note: nothing is read through a link, nothing after it changed] Everything under a
submission folder belongs to students who may still write to it while grading runs. So each
folder is opened once, without following a link, and everything below is opened relative to
that open folder (`os.open(..., dir_fd=...)`, O_NOFOLLOW): a folder or file swapped for a link
after the listing fails to open instead of leading elsewhere. The checks are made on the open
file — a regular file, one link to it, owned by the grader, by the owner of the folder named
on the command line or by the owner of its student's folder — and the copy is made from that
same open file, into the grader's private folder, before the first submission runs. The
instructor's own arguments are trusted: one may be a link, resolved once, and what it resolves
to names it.

[Note: a student prints as one student] A name is shown in NFC with every invisible, format,
separator or private character escaped (`printed_name`); names that would still look alike
(accents composed or not, Cyrillic or Greek letters that look Latin) are all shown with their
non-ASCII characters as code points, and a name is never shown as another's.

Students are graded in turns — every student's first file, then every student's second, ... —
at most `MAX_FILES_PER_STUDENT` each, so one student's thousand files cannot hold up the class.
"""

from __future__ import annotations

import errno
import os
import stat
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from fsdp_lab.course.submission import SUFFIXES
from fsdp_lab.course.verdict import printable

MAX_FILE_BYTES = 16 << 20  # a submission larger than this is refused unread
MAX_FILES_PER_STUDENT = 10
OPEN_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO or a device opens without waiting for a writer; its type is checked next.
OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
HIDDEN = (".", "__")  # .ipynb_checkpoints/, __pycache__/: Jupyter's and Python's, not a student's


@dataclass(frozen=True)
class Submission:
    """One file to grade: how it is shown, whose it is, its copy made before grading began (in
    the grader's private folder; or why it cannot be graded)."""

    shown: str
    student: str
    name: str
    copy: Path | None = None
    error: str | None = None


@dataclass(frozen=True)
class _Found:
    """A file as found, before names are printed: its path's parts as they are on disk."""

    top: str  # the instructor's argument, as typed
    parts: tuple[str, ...]  # below it
    student: str  # the raw name of its student
    copy: Path | None = None
    why: str | None = None  # why it is not graded


def submissions(paths: Iterable[Path], snapshot: Path) -> list[Submission]:
    """The files to grade, in order, each copied now into `snapshot` (a folder only the grader
    can read). Folders are searched recursively for files (links refused); the student is the
    first folder below the one given, as in nbgrader's submitted/<student>/<assignment>/, else
    the file's name. A path that gives nothing to grade is a Submission with its error."""
    paths = list(paths)
    found: list[_Found] = []
    # Several folders named (`submitted/*`): a student is named with the folder it came from,
    # or every student's "ps1/" would be one student "ps1".
    named = sum(_is_folder(p) for p in paths) > 1
    for path in paths:
        found += _found_under(path, named, snapshot, len(found))
    return _printed(found)


def _is_folder(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a name longer than the system allows: its row says so below
        return False


def _found_under(path: Path, named: bool, snapshot: Path, counted: int) -> list[_Found]:
    """What one argument of the instructor's holds (a link is followed: it is theirs)."""
    top = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        why = "no such file or folder" if exc.errno == errno.ENOENT else exc.strerror
        return [_Found(top, (), "", why=f"{why}")]
    try:
        info = os.fstat(fd)
        if not stat.S_ISDIR(info.st_mode):  # a file named on the command line
            student = Path(os.path.realpath(path)).stem
            return [_copied(fd, top, (), student, snapshot / str(counted), owners=None)]
        prefix = f"{Path(os.path.realpath(path)).name}/" if named else ""
        found: list[_Found] = []
        for parts, file_fd, why, owners in _walk(fd, (), {os.geteuid(), info.st_uid}):
            student = prefix + (parts[0] if len(parts) > 1 else Path(parts[-1]).stem)
            if file_fd is None:
                found.append(_Found(top, parts, student, why=why))
                continue
            copy = snapshot / str(counted + len(found))
            try:
                found.append(_copied(file_fd, top, parts, student, copy, owners))
            finally:
                os.close(file_fd)
        return found or [_Found(top, (), "", why="no files in it")]
    finally:
        os.close(fd)


def _walk(
    folder: int, parts: tuple[str, ...], owners: set[int]
) -> Iterator[tuple[tuple[str, ...], int | None, str | None, set[int]]]:
    """(parts, an open file or None, why not, its allowed owners) for every file below the
    open `folder`, in name order; folders are opened relative to it, never through a link."""
    with os.scandir(folder) as listing:
        names = sorted(entry.name for entry in listing)
    for name in names:
        here = (*parts, name)
        try:
            kind = os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode
        except OSError as exc:  # gone since the listing
            yield here, None, f"cannot be read ({exc.strerror})", owners
            continue
        if stat.S_ISLNK(kind):
            yield here, None, "a symbolic link — refused (submit the file itself)", owners
        elif stat.S_ISDIR(kind):
            if name.startswith(HIDDEN):
                continue
            try:
                below = os.open(name, OPEN_FOLDER, dir_fd=folder)
            except OSError as exc:  # swapped for a link (ELOOP) or a file since the lstat
                yield here, None, f"changed while being read — refused ({exc.strerror})", owners
                continue
            try:  # a student's folder: its owner's files are theirs
                mine = owners | {os.fstat(below).st_uid} if not parts else owners
                yield from _walk(below, here, mine)
            finally:
                os.close(below)
        elif name.startswith(HIDDEN) and not name.endswith(SUFFIXES):
            continue
        elif name.startswith(HIDDEN):
            yield here, None, (f"a hidden file (its name starts with {name[:2]!r}) — not "
                               "graded; rename it"), owners  # fmt: skip
        elif not name.endswith(SUFFIXES):
            yield (
                here,
                None,
                "not a notebook (.ipynb) or Python file (.py) — nothing graded",
                owners,
            )
        else:
            try:
                yield here, os.open(name, OPEN_FILE, dir_fd=folder), None, owners
            except OSError as exc:  # swapped for a link (ELOOP) since the lstat, unreadable
                why = "a symbolic link — refused" if exc.errno == errno.ELOOP else exc.strerror
                yield here, None, f"cannot be read ({why})", owners


def _copied(
    fd: int, top: str, parts: tuple[str, ...], student: str, copy: Path, owners: set[int] | None
) -> _Found:
    """The open file `fd` copied to `copy`, or why it is not graded (`owners`: the users whose
    files may be graded here; None: any, for a file the instructor named)."""
    name = parts[-1] if parts else Path(top).name

    def refused(why: str) -> _Found:
        return _Found(top, parts, student, why=why)

    if not name.endswith(SUFFIXES):
        return refused("not a notebook (.ipynb) or Python file (.py) — nothing graded")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        return refused("not a regular file — nothing graded")
    if info.st_nlink > 1:
        return refused("a hard link to another file — refused (submit the file itself)")
    if owners is not None and info.st_uid not in owners:
        return refused(f"owned by user {info.st_uid}, neither the grader nor its student's "
                       "folder's owner — refused (submit your own file)")  # fmt: skip
    if info.st_size > MAX_FILE_BYTES:
        return refused(f"larger than {MAX_FILE_BYTES >> 20} MiB — not graded")
    try:
        data = _read_all(fd, MAX_FILE_BYTES + 1)
        out = os.open(
            copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )  # fmt: skip  (the sandbox's user reads it)
        with os.fdopen(out, "wb") as f:
            f.write(data[:MAX_FILE_BYTES])
    except OSError as exc:
        return refused(f"cannot be read ({printable(str(exc))[:200]})")
    return _Found(top, parts, student, copy=copy)


def _read_all(fd: int, limit: int) -> bytes:
    chunks, total = [], 0
    while total < limit and (chunk := os.read(fd, min(1 << 20, limit - total))):
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


# -- names as printed ---------------------------------------------------------------------------

# Characters no terminal shows as a mark of their own (Unicode's Default_Ignorable_Code_Point
# set, which unicodedata does not carry): fillers that render as blanks, variation selectors.
_IGNORABLE = {0x115F, 0x1160, 0x17B4, 0x17B5, 0x3164, 0xFFA0, 0x034F,
              *range(0x180B, 0x1810), *range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0)}  # fmt: skip
_UNSEEN = ("Cc", "Cf", "Co", "Cn", "Cs", "Zl", "Zp", "Zs")
# Letters that look like Latin ones, for telling names apart (a small part of Unicode's
# confusables: the Cyrillic and Greek letters a class list is most likely to meet).
_LOOKS_LATIN = str.maketrans(
    "асеорхуіјѕԁһӏԛԝАВСЕНІЈКМОРЅТХУαβεικνορτυχΑΒΕΖΗΙΚΜΝΟΡΤΥΧ",
    "aceopxyijsdhlqwABCEHIJKMOPSTXYabeikvoptuxABEZHIKMNOPTYX",
)


def printed_name(raw: str) -> str:
    """`raw` as a report shows it: NFC, and every character that prints as nothing (or as a
    blank other than an inner space) escaped; ASCII spaces at its ends escaped too."""
    text = printable(unicodedata.normalize("NFC", raw))
    shown = "".join(
        f"\\u{ord(c):04x}" if c != " " and (unicodedata.category(c) in _UNSEEN
                                           or ord(c) in _IGNORABLE) else c
        for c in text
    )  # fmt: skip
    core = shown.strip(" ")
    if core == shown:
        return shown
    lead, trail = len(shown) - len(shown.lstrip(" ")), len(shown) - len(shown.rstrip(" "))
    return "\\x20" * lead + core + "\\x20" * trail


def _looks(shown: str) -> str:
    """What a reader can tell `shown` by: accents and marks dropped, look-alike letters Latin."""
    bare = "".join(c for c in unicodedata.normalize("NFKD", shown) if not unicodedata.combining(c))
    return bare.translate(_LOOKS_LATIN)


def _code_points(raw: str) -> str:
    return "".join(c if c.isascii() and c.isprintable() else f"\\u{ord(c):04x}" for c in raw)


def distinct_names(raws: list[str]) -> dict[str, str]:
    """Each raw name and how it is shown: `printed_name`, unless another name would look the
    same — then with its non-ASCII characters as code points — and never as another's."""
    groups: dict[str, set[str]] = {}
    for raw in dict.fromkeys(raws):
        groups.setdefault(_looks(printed_name(raw)), set()).add(raw)
    shown = {}
    for same in groups.values():
        for raw in sorted(same):
            shown[raw] = printed_name(raw) if len(same) == 1 else _code_points(raw)
    taken: set[str] = set()
    for raw in sorted(shown):  # still alike (a name typed as another's escape): numbered
        name, k = shown[raw], 2
        while shown[raw] in taken:
            shown[raw] = f"{name} [{k}]"
            k += 1
        taken.add(shown[raw])
    return shown


def _printed(found: list[_Found]) -> list[Submission]:
    students = distinct_names([f.student for f in found if f.student])
    paths = distinct_names([os.path.join(f.top, *f.parts) for f in found])
    rows = []
    for f in found:
        shown = paths[os.path.join(f.top, *f.parts)]
        name = f.parts[-1] if f.parts else Path(f.top).name
        row = Submission(shown, students.get(f.student, ""), name, copy=f.copy)
        rows.append(replace(row, error=f"{shown}: {f.why}") if f.why else row)
    return rows


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
