"""Which files a class has, whose they are, and how their students print (`course.roster`).

[Issue 51, classes "paths" and "names"] Everything under a submission folder is untrusted and
may change while the grader reads it: every file is opened without following links, relative
to a folder the grader holds open, checked (type, links, owner) on the open file and copied
from it. The instructor's own argument may be a link and is resolved once. A student's name
is unique as printed: NFC, invisible and format characters escaped, and names that would still
print alike shown with their code points.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fsdp_lab.course.roster import submissions

ALICE = "def all_reduce_mean(tensor, group):\n    return tensor  # alice's\n"
BOB = "def all_reduce_mean(tensor, group):\n    return tensor * 0  # bob's\n"


def _class(root: Path, students: dict[str, str], assignment: str = "ps1") -> Path:
    for who, text in students.items():
        folder = root / "submitted" / who / assignment
        folder.mkdir(parents=True)
        (folder / "work.py").write_text(text)
    return root / "submitted"


class _SwapAfterListing:
    """os.scandir, but once the class folder has been listed, `swap()` runs: the moment a
    student swaps their folder after the grader saw it."""

    def __init__(self, real, swap) -> None:
        self.real, self.swap, self.calls = real, swap, 0

    def __call__(self, *args):
        self.calls += 1
        with self.real(*args) as it:
            entries = list(it)
        if self.calls == 1:
            self.swap()
        return _Listing(entries)


class _Listing(list):
    def __enter__(self):
        return iter(self)

    def __exit__(self, *exc) -> None:
        pass

    def close(self) -> None:
        pass


def _graded(rows) -> dict[str, str]:
    """student -> the text of the copy graded as theirs ('' where none was)."""
    return {r.student: r.copy.read_text() if r.copy else "" for r in rows}


# -- paths ------------------------------------------------------------------------------------


def test_a_folder_swapped_for_a_link_after_the_listing_grades_nobody_elses_file(tmp_path,
                                                                               monkeypatch):  # fmt: skip
    """Item 1: bob swaps his folder for a link to alice's right after the grader lists the
    class; he used to be graded with alice's file."""
    folder = _class(tmp_path, {"alice": ALICE, "bob": BOB})

    def swap() -> None:
        (folder / "bob").rename(tmp_path / "bob-was")
        (folder / "bob").symlink_to(folder / "alice")

    monkeypatch.setattr(os, "scandir", _SwapAfterListing(os.scandir, swap))
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    rows = submissions([folder], snapshot)
    graded = _graded(rows)
    assert graded["alice"] == ALICE
    assert ALICE not in graded.get("bob", ""), "bob was graded with alice's file"
    (bob,) = [r for r in rows if r.student == "bob"]
    assert bob.copy is None and "link" in bob.error


def test_a_file_swapped_for_a_link_after_the_listing_is_refused(tmp_path, monkeypatch):
    folder = _class(tmp_path, {"alice": ALICE, "bob": BOB})
    bobs = folder / "bob" / "ps1"
    real, swapped = os.scandir, []

    def scandir(target):  # bob's file swapped once his assignment folder has been listed
        with real(target) as it:
            entries = list(it)
        here = os.fstat(target) if isinstance(target, int) else os.stat(target)
        if not swapped and os.path.samestat(here, os.stat(bobs)):
            swapped.append(True)
            (bobs / "work.py").unlink()
            (bobs / "work.py").symlink_to(folder / "alice" / "ps1" / "work.py")
        return _Listing(entries)

    monkeypatch.setattr(os, "scandir", scandir)
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    graded = _graded(submissions([folder], snapshot))
    assert swapped and graded["alice"] == ALICE and ALICE not in graded["bob"]


def test_a_course_folder_given_as_a_link_is_graded(tmp_path):
    """Item 7: `fsdp-lab grade submitted/` where submitted is a link graded nobody."""
    folder = _class(tmp_path / "real", {"alice": ALICE})
    (tmp_path / "submitted").symlink_to(folder)
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    (row,) = submissions([tmp_path / "submitted"], snapshot)
    assert row.student == "alice" and row.copy is not None and row.copy.read_text() == ALICE


def test_a_file_given_as_a_link_by_the_instructor_is_graded(tmp_path):
    (tmp_path / "alice.py").write_text(ALICE)
    (tmp_path / "link.py").symlink_to(tmp_path / "alice.py")
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    (row,) = submissions([tmp_path / "link.py"], snapshot)
    assert row.copy is not None and row.copy.read_text() == ALICE


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root (CI grades as root)")
def test_a_file_owned_by_another_user_in_a_students_folder_is_refused(tmp_path):
    """A classmate's file planted in bob's folder (a folder others may write): refused on the
    open file, naming its owner."""
    folder = _class(tmp_path, {"bob": BOB})
    bob = folder / "bob"
    os.chown(bob, 4321, 4321)
    os.chown(bob / "ps1", 4321, 4321)
    os.chown(bob / "ps1" / "work.py", 4321, 4321)
    planted = bob / "ps1" / "planted.py"
    planted.write_text(ALICE)
    os.chown(planted, 5555, 5555)
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    rows = {r.name: r for r in submissions([folder], snapshot)}
    assert rows["work.py"].copy is not None  # bob's own file
    assert rows["planted.py"].copy is None and "owned by user 5555" in rows["planted.py"].error


def test_a_fifo_named_like_a_submission_is_a_row_not_a_hang(tmp_path):
    folder = _class(tmp_path, {"alice": ALICE})
    os.mkfifo(folder / "alice" / "ps1" / "pipe.py")
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    rows = {r.name: r for r in submissions([folder], snapshot)}
    assert rows["pipe.py"].copy is None and "not a regular file" in rows["pipe.py"].error
    assert rows["work.py"].copy is not None


# -- names ------------------------------------------------------------------------------------

LOOKALIKES = {
    "nbsp": ("zoe", "zoe\u00a0"),
    "hangul filler": ("zoe", "zoe\u3164"),
    "nfc/nfd": ("zo\u00e9", "zoe\u0301"),
    "cyrillic o": ("zoe", "z\u043ee"),  # own case: a homoglyph
    "trailing space": ("zoe", "zoe "),  # own case: ASCII, and invisible at a line's end
    "line separator": ("zoe", "zoe\u2028"),  # own case: U+2028 breaks the table's line
}


def _looks(name: str) -> str:
    """What a reader sees: accents and invisible characters gone, homoglyphs as Latin."""
    import unicodedata

    shown = unicodedata.normalize("NFKD", name).strip()
    shown = "".join(c for c in shown if not unicodedata.combining(c)
                    and (c == " " or unicodedata.category(c) not in ("Cf", "Zs", "Zl", "Zp"))
                    and c not in "\u115f\u1160\u3164\uffa0")  # fmt: skip
    return shown.translate({0x43E: "o", 0x435: "e", 0x430: "a", 0x440: "p", 0x441: "c"})


def _students_named(tmp_path: Path, names: tuple[str, ...]) -> list:
    """The class of one file per student folder named so, listed."""
    folder = tmp_path / "submitted"
    for k, who in enumerate(names):
        (folder / who).mkdir(parents=True)
        (folder / who / "work.py").write_text(f"x = {k}\n")
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    return submissions([folder], snapshot)


@pytest.mark.parametrize("pair", LOOKALIKES.values(), ids=LOOKALIKES.keys())
def test_two_students_never_print_as_one(tmp_path, pair):
    """Item 6: names that look alike print distinguishably, in the table, CSV and JSON alike
    (they are the rows' `student`)."""
    rows = _students_named(tmp_path, pair)
    names = [r.student for r in rows]
    assert len({_looks(n) for n in names}) == 2, names
    assert len({_looks(r.shown) for r in rows}) == 2, [r.shown for r in rows]
    assert all(n.isprintable() for n in names), names


def test_a_plain_accented_name_prints_as_written(tmp_path):
    folder = tmp_path / "submitted"
    (folder / "zo\u00e9").mkdir(parents=True)
    (folder / "zo\u00e9" / "work.py").write_text("x = 1\n")
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    (row,) = submissions([folder], snapshot)
    assert row.student == "zo\u00e9"


# -- found by a hostile review ---------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="lchown needs root (CI grades as root)")
def test_a_students_link_named_by_a_shell_glob_is_not_followed(tmp_path):
    """`fsdp-lab grade submitted/*/ps1`: the shell named alice's `ps1`, a link she owns to a
    folder of the grader's; it was followed and its files graded as hers."""
    folder = _class(tmp_path, {"bob": BOB})
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key.py").write_text(ALICE)
    (folder / "alice").mkdir()
    (folder / "alice" / "ps1").symlink_to(secret)
    os.lchown(folder / "alice" / "ps1", 4321, 4321)
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    rows = submissions(sorted(folder.glob("*/ps1")), snapshot)
    alice = [r for r in rows if "alice" in r.shown]
    assert len(alice) == 1 and alice[0].copy is None and "owned by user 4321" in alice[0].error
    assert [r.student for r in rows if r.copy is not None] == ["bob/ps1"]


def test_folders_nested_past_the_limit_are_one_row_and_the_class_is_graded(tmp_path):
    """1,200 nested folders made the walk raise RecursionError: no row for anyone."""
    folder = _class(tmp_path, {"alice": ALICE})
    deep = folder / "mallory"
    for _ in range(40):
        deep = deep / "d"
    deep.mkdir(parents=True)
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    rows = {r.student: r for r in submissions([folder], snapshot)}
    assert rows["alice"].copy is not None
    assert rows["mallory"].copy is None and "nested deeper" in rows["mallory"].error


def test_a_hard_link_made_elsewhere_to_a_students_file_does_not_cost_them_it(tmp_path):
    """Any file with two links was refused: a classmate who could link bob's file from
    outside the class took bob's grade. What matters is whose the file is."""
    folder = _class(tmp_path, {"bob": BOB})
    os.link(folder / "bob" / "ps1" / "work.py", tmp_path / "elsewhere.py")
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    (row,) = submissions([folder], snapshot)
    assert row.copy is not None and row.copy.read_text() == BOB


def test_an_empty_students_folder_is_a_row(tmp_path):
    folder = _class(tmp_path, {"alice": ALICE})
    (folder / "bob").mkdir()
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    rows = {r.student: r for r in submissions([folder], snapshot)}
    assert "no files" in rows["bob"].error


@pytest.mark.parametrize("pair", [("zoe", "zoe\u2800"), ("zoe", "z\u0585e")],
                         ids=["braille blank", "armenian oh"])  # fmt: skip
def test_names_a_review_found_alike_print_apart(tmp_path, pair):
    names = [r.student for r in _students_named(tmp_path, pair)]
    assert "zoe" in names and all(n == "zoe" or "\\u" in n for n in names), names
