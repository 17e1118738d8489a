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
from dataclasses import dataclass, field, replace
from pathlib import Path

from fsdp_lab.course.submission import SUFFIXES
from fsdp_lab.course.verdict import printable
from fsdp_lab.outputs import read_open

MAX_FILE_BYTES = 16 << 20  # a submission larger than this is refused unread
MAX_FILES_PER_STUDENT = 10
MAX_DEPTH = 16  # folders below the one named; deeper is not searched (a row says so)
OPEN_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO or a device opens without waiting for a writer; its type is checked next.
OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
HIDDEN = (".", "__")  # .ipynb_checkpoints/, __pycache__/: Jupyter's and Python's, not a student's
NOT_STUDENTS = ("timestamp.txt",)  # nbgrader's own file in every submission
OVER_THE_CAP = "not graded: more than {} files per student (--max-files-per-student)"


@dataclass(frozen=True)
class Submission:
    """One file to grade: how it is shown, whose it is, its copy made before grading began (in
    the grader's private folder; or why it cannot be graded)."""

    shown: str
    student: str
    name: str
    copy: Path | None = None
    error: str | None = None


class SnapshotError(OSError):
    """The grader could not write a copy into its own folder (a full disk): the grader's
    problem, never a student's row."""


@dataclass(frozen=True)
class _Found:
    """A file as found, before names are printed: its path's parts as they are on disk."""

    top: str  # the instructor's argument, as typed
    parts: tuple[str, ...]  # below it
    student: str  # the raw name of its student
    copy: Path | None = None
    why: str | None = None  # why it is not graded


def submissions(
    paths: Iterable[Path], snapshot: Path, max_files: int = MAX_FILES_PER_STUDENT
) -> list[Submission]:
    """The files to grade, in order, each copied now into `snapshot` (a folder only the grader
    can read), at most `max_files` per student (the others get a row each, uncopied). Folders
    are searched recursively for files (links refused); the student is the first folder below
    the one given, as in nbgrader's submitted/<student>/<assignment>/, else the file's name;
    several folders named (`submitted/*`), each is named by the end of its path that tells it
    from the others. A path that gives nothing to grade is a Submission with its error.
    SnapshotError if a copy cannot be written."""
    paths = list(paths)
    labels = _labels(paths)
    copier = _Copier(snapshot, max_files)
    found: list[_Found] = []
    for k, path in enumerate(paths):
        found += _found_under(path, labels.get(k), copier)
    return _printed(found)


def _labels(paths: list[Path]) -> dict[int, str]:
    """Several folders named: each one's label, the shortest end of its path that no other
    named folder's ends with (`submitted/*/ps1` gives alice/ps1, bob/ps1)."""
    tails = {k: Path(os.path.abspath(p)).parts for k, p in enumerate(paths) if _is_folder(p)}
    if len(tails) < 2:
        return {}
    labels = {}
    for k, parts in tails.items():
        for n in range(1, len(parts) + 1):
            if all(other[-n:] != parts[-n:] for j, other in tails.items() if j != k):
                break
        labels[k] = "/".join(parts[-n:])
    return labels


def _is_folder(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a name longer than the system allows: its row says so below
        return False


class _Refused(Exception):
    """A named path the grader will not follow (a link a student owns)."""


def _open_named(path: Path) -> int:
    """The instructor's path, opened one folder at a time from /, never through a link unless
    the link is the grader's own or root's (one a student owns, anywhere along the path — a
    student folder a shell glob named — is refused). O_NOFOLLOW: an entry swapped for a link
    since it was looked at fails to open."""
    trusted, hops = {0, os.geteuid()}, 0
    todo = list(Path(os.path.abspath(path)).parts[1:])
    fd = os.open("/", OPEN_FOLDER)
    try:
        while todo:
            name = todo.pop(0)
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):
                if info.st_uid not in trusted:
                    raise _Refused(f"a link owned by user {info.st_uid} ({name!r} on the way) "
                                   "— refused: name the folder it points to yourself")  # fmt: skip
                hops += 1
                if hops > 40:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
                target = os.readlink(name, dir_fd=fd)
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", OPEN_FOLDER)
                todo = [*Path(target).parts[target.startswith("/") :], *todo]
                continue
            flags = OPEN_FOLDER if todo or stat.S_ISDIR(info.st_mode) else OPEN_FILE
            below = os.open(name, flags, dir_fd=fd)
            os.close(fd)
            fd = below
        return fd
    except BaseException:
        os.close(fd)
        raise


def _found_under(path: Path, label: str | None, copier: _Copier) -> list[_Found]:
    """What one argument of the instructor's holds; `label`: its name when several folders
    are named."""
    top = str(path)
    try:
        fd = _open_named(path)
    except _Refused as exc:
        return [_Found(top, (), "", why=str(exc))]
    except OSError as exc:
        why = "no such file or folder" if exc.errno == errno.ENOENT else exc.strerror
        return [_Found(top, (), "", why=f"{why}")]
    try:
        info = os.fstat(fd)
        if not stat.S_ISDIR(info.st_mode):  # a file named on the command line: trusted
            return [copier.copy(fd, top, (), Path(os.path.abspath(path)).stem, owners=None)]
        found: list[_Found] = []
        for parts, file_fd, why, owners in _walk(fd, (), {info.st_uid}, label is None):
            if label is not None:
                student = label if len(parts) == 1 else f"{label}/{parts[0]}"
            else:
                student = parts[0] if len(parts) > 1 else Path(parts[-1]).stem
            if file_fd is None:
                found.append(_Found(top, parts, student, why=why))
                continue
            try:
                found.append(copier.copy(file_fd, top, parts, student, owners))
            finally:
                os.close(file_fd)
        return found or [_Found(top, (), label or "", why="no files in it")]
    finally:
        os.close(fd)


Listed = tuple[tuple[str, ...], int | None, str | None, set[int]]


def _walk(folder: int, parts: tuple[str, ...], owners: set[int], students_below: bool
          ) -> Iterator[Listed]:  # fmt: skip
    """(parts, an open file or None, why not, whose files count there) for every file below the
    open `folder`, in name order; folders are opened relative to it, never through a link.

    A file counts only if it belongs to the owner of a folder it is in, from its student's
    folder down (`owners`): whoever else can write there owns none of them. `students_below`:
    each folder below this one is a student's (one folder named)."""
    if len(parts) >= MAX_DEPTH:
        yield parts, None, f"folders nested deeper than {MAX_DEPTH} — not searched", owners
        return
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
            except OSError as exc:  # swapped for a link (ELOOP) since the lstat, unreadable
                why = "changed while being read — refused" if exc.errno == errno.ELOOP else (
                    f"cannot be read ({exc.strerror})")  # fmt: skip
                yield here, None, why, owners
                continue
            try:
                mine = os.fstat(below).st_uid
                if not (students_below and not parts):
                    yield from _walk(below, here, owners | {mine}, False)
                    continue
                empty = True  # a student's folder: its owner's files count in it
                for listed in _walk(below, here, {mine}, False):
                    empty = False
                    yield listed
                if empty:  # nothing in it: a row all the same, or the student is not listed
                    yield here, None, "no files in this student's folder", {mine}
            finally:
                os.close(below)
        elif name.startswith(HIDDEN) and not name.endswith(SUFFIXES) or name in NOT_STUDENTS:
            continue
        elif name.startswith(HIDDEN):
            yield here, None, (f"a hidden file (its name starts with {name[:2]!r}) — not "
                               "graded; rename it"), owners  # fmt: skip
        elif not name.endswith(SUFFIXES):
            why = "not a notebook (.ipynb) or Python file (.py) — nothing graded"
            yield here, None, why, owners
        else:
            try:
                yield here, os.open(name, OPEN_FILE, dir_fd=folder), None, owners
            except OSError as exc:  # swapped for a link (ELOOP) since the lstat, unreadable
                why = "a symbolic link — refused" if exc.errno == errno.ELOOP else exc.strerror
                yield here, None, f"cannot be read ({why})", owners


@dataclass
class _Copier:
    """Copies into the grader's folder, at most `max_files` per student."""

    folder: Path
    max_files: int
    made: int = 0
    per_student: dict[str, int] = field(default_factory=dict)

    def copy(
        self, fd: int, top: str, parts: tuple[str, ...], student: str, owners: set[int] | None
    ) -> _Found:
        """The open file `fd` copied, or why it is not graded (`owners`: the users whose files
        count there; None: any, for a file the instructor named)."""
        name = parts[-1] if parts else Path(top).name

        def refused(why: str) -> _Found:
            return _Found(top, parts, student, why=why)

        if not name.endswith(SUFFIXES):
            return refused("not a notebook (.ipynb) or Python file (.py) — nothing graded")
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return refused("not a regular file — nothing graded")
        if owners is not None and info.st_uid not in owners:
            return refused(f"owned by user {info.st_uid}, who owns none of the folders it is in "
                           f"from its student's folder down (users {sorted(owners)}) — refused: "
                           "submit your own file")  # fmt: skip
        if info.st_size > MAX_FILE_BYTES:
            return refused(f"larger than {MAX_FILE_BYTES >> 20} MiB — not graded")
        if self.per_student.get(student, 0) >= self.max_files:
            return refused(OVER_THE_CAP.format(self.max_files))
        try:
            data = read_open(fd, MAX_FILE_BYTES + 1)
        except OSError as exc:
            return refused(f"cannot be read ({printable(str(exc))[:200]})")
        copy = self.folder / str(self.made)
        try:
            out = os.open(
                copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
            )  # fmt: skip  (the sandbox's user reads it)
            with os.fdopen(out, "wb") as f:
                f.write(data[:MAX_FILE_BYTES])
        except OSError as exc:
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            hint = " — free space there or point TMPDIR elsewhere" if full else ""
            raise SnapshotError(exc.errno, f"copying {top} into the grader's folder "
                                f"{self.folder}: {exc.strerror}{hint}") from exc  # fmt: skip
        self.made += 1
        self.per_student[student] = self.per_student.get(student, 0) + 1
        return _Found(top, parts, student, copy=copy)


# -- names as printed ---------------------------------------------------------------------------

# Characters no terminal shows as a mark of their own: Unicode's Default_Ignorable_Code_Point
# set, which unicodedata does not carry (fillers that render as blanks, variation selectors),
# and the Braille blank, a symbol that draws nothing.
_IGNORABLE = {0x115F, 0x1160, 0x17B4, 0x17B5, 0x3164, 0xFFA0, 0x034F, 0x2800,
              *range(0x180B, 0x1810), *range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0)}  # fmt: skip
# Scripts written together in one name (Japanese mixes three); any other mix of scripts in a
# name is what a look-alike is made of (UTS #39's mixed-script rule).
_ONE_SCRIPT = {"CJK": "HAN", "HIRAGANA": "HAN", "KATAKANA": "HAN", "HANGUL": "HAN",
               "BOPOMOFO": "HAN"}  # fmt: skip
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
    """What a reader can tell `shown` by: compatibility forms folded (NFKC: a full-width z is a
    z), letters that look Latin made Latin; accents stay — they are seen."""
    return unicodedata.normalize("NFKC", shown).translate(_LOOKS_LATIN)


def _code_points(raw: str) -> str:
    return "".join(c if c.isascii() and c.isprintable() else f"\\u{ord(c):04x}" for c in raw)


def _scripts(text: str) -> set[str]:
    """The scripts of `text`'s letters, by the first word of their Unicode names."""
    found = set()
    for c in text:
        if unicodedata.category(c).startswith("L"):
            script = unicodedata.name(c, "UNKNOWN").split()[0]
            found.add(_ONE_SCRIPT.get(script, script))
    return found


def distinct_names(raws: list[str]) -> dict[str, str]:
    """Each raw name and how it is shown: `printed_name`, unless another name would look the
    same or it mixes scripts — then with its non-ASCII characters as code points — and never
    as another's."""
    groups: dict[str, set[str]] = {}
    for raw in dict.fromkeys(raws):
        groups.setdefault(_looks(printed_name(raw)), set()).add(raw)
    shown = {}
    for same in groups.values():
        for raw in sorted(same):
            mixed = len(_scripts(raw)) > 1  # `zօe`: Latin with an Armenian o, looks like zoe
            shown[raw] = printed_name(raw) if len(same) == 1 and not mixed else _code_points(raw)
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


def fair_order(todo: list[Submission]) -> list[Submission]:
    """Every student's first file, then every student's second, ... (one student's thousand
    files cannot hold up the class; `submissions` copied at most the cap of each)."""
    by_student: dict[str, list[Submission]] = {}
    for sub in todo:
        by_student.setdefault(sub.student or sub.shown, []).append(sub)
    rounds = max((len(subs) for subs in by_student.values()), default=0)
    return [subs[k] for k in range(rounds) for subs in by_student.values() if k < len(subs)]
