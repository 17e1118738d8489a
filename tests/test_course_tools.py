"""Course tooling: `fsdp-lab grade` on a folder of submissions, nbgrader on the learner
notebooks, `fsdp-lab bugs`. Each `fsdp-lab` here is the real console script in its own process,
as an instructor runs it."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import psutil
import pytest

from fsdp_lab.course import LABS
from fsdp_lab.course.authoring import FOLDER, notebook_name

COLLECTIVES = FOLDER / notebook_name("collectives")
FSDP_LAB = [sys.executable, "-m", "fsdp_lab"]

CORRECT_PY = """\
import torch.distributed as dist
from fsdp_lab import comm


def all_reduce_mean(tensor, group):
    out = tensor.clone()
    comm.all_reduce(out, group=group)
    return out / dist.get_world_size(group)
"""


def fill(nb, bodies: dict[str, str]):
    """The notebook with each learner cell's `raise NotImplementedError()` replaced by the body
    given for it (as a learner writes it), or left as it is."""
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution") and meta["grade_id"] in bodies:
            cell.source = cell.source.replace(
                "raise NotImplementedError()", bodies[meta["grade_id"]]
            )
    return nb


SUM_ONLY = "out = tensor.clone()\n    comm.all_reduce(out, group=group)\n    return out"


def run(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*FSDP_LAB, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


# A whole `fsdp-lab grade` of three files (20 s here): the graded classes (test_grading_trust.py,
# e2e too) grade correct, wrong and broken files beside the attacks; the suite keeps one
# multi-file grade (a grader error on one file).
@pytest.mark.e2e
def test_grade_scores_a_correct_a_buggy_and_a_broken_submission(tmp_path):
    subs = tmp_path / "submitted"
    for who in ("alice", "bob", "carol", "dan"):
        (subs / who).mkdir(parents=True)
    (subs / "alice" / "ex.py").write_text(CORRECT_PY)
    buggy = fill(nbformat.read(COLLECTIVES, as_version=4), {"all_reduce_mean": SUM_ONLY})
    nbformat.write(buggy, subs / "bob" / COLLECTIVES.name)
    (subs / "carol" / COLLECTIVES.name).write_text('{"cells": [ this is not json')
    (subs / "dan" / "answers.txt").write_text("def all_reduce_mean(t, g): ...")
    (tmp_path / "empty").mkdir()
    proc = run(
        "grade",
        str(subs),
        str(tmp_path / "empty"),
        "--json",
        "--csv",
        "grades.csv",
        "--time-limit",
        "8",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    results = {
        Path(r["file"]).relative_to(tmp_path).as_posix(): r
        for r in json.loads(proc.stdout)["submissions"]
    }
    alice = results["submitted/alice/ex.py"]
    assert alice["verdicts"][0]["kind"] == "passed", alice
    assert alice["student"] == "submitted/alice"  # two folders named: each student with hers
    bob = {v["exercise"]: v for v in results[f"submitted/bob/{COLLECTIVES.name}"]["verdicts"]}
    assert bob["all_reduce_mean"]["score"] == 0
    assert "SUM where the average was meant" in bob["all_reduce_mean"]["hint"]
    assert [v["kind"] for n, v in bob.items() if n != "all_reduce_mean"] == ["not implemented"] * (
        len(LABS["collectives"]) - 1
    )
    # Bad input: one line each, and grading went on.
    by_file = {r["file"]: r for r in json.loads(proc.stdout)["submissions"]}
    errors = {
        Path(f).relative_to(tmp_path).as_posix(): r["error"]
        for f, r in by_file.items()
        if "error" in r
    }
    assert set(errors) == {
        f"submitted/carol/{COLLECTIVES.name}",
        "submitted/dan/answers.txt",
        "empty",
    }
    assert "not a readable notebook" in errors[f"submitted/carol/{COLLECTIVES.name}"]
    assert "not a notebook (.ipynb) or Python file" in errors["submitted/dan/answers.txt"]
    assert "no files in it" in errors["empty"]
    # (a path that does not exist is wrong input, before any file: test_grading_trust.py)
    # No grading process and no rank is left behind.
    left = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if "fsdp_lab.course.submission" in " ".join(p.info["cmdline"] or [])
    ]
    assert not left
    # The gradebook CSV: one row per submission, scores per exercise.
    rows = {r["student"]: r for r in csv.DictReader((tmp_path / "grades.csv").open())}
    assert rows["submitted/alice"]["all_reduce_mean"] == "2"
    assert rows["submitted/bob"]["all_reduce_mean"] == "0"
    assert rows["submitted/carol"]["error"].startswith(
        f"the submission's process said: {COLLECTIVES.name}"
    )
    # The progress lines went to stderr, one per file.
    assert "[1/" in proc.stderr and "gradebook CSV: grades.csv" in proc.stderr


def test_grade_refuses_an_exercise_that_does_not_exist(tmp_path):
    proc = run("grade", str(tmp_path), "--only", "all_reduce_mena", cwd=tmp_path)
    assert proc.returncode == 2
    assert "did you mean 'all_reduce_mean'" in proc.stderr


# nbgrader's whole pipeline (generate, then autograde in a kernel: 27 s here), end to end; the
# notebooks' nbgrader metadata is tested in the suite (test_exercise_notebooks.py).
@pytest.mark.e2e
def test_nbgrader_generates_the_assignments_and_autogrades_a_submission(tmp_path):
    """nbgrader's own API (what its command line calls), in this process: one assignment per
    lab notebook, then autograde of one learner's submission."""
    pytest.importorskip("nbgrader")
    from nbgrader.api import Gradebook
    from nbgrader.apps import NbGraderAPI
    from traitlets.config import Config

    course = tmp_path / "course"
    for path in sorted(FOLDER.glob("*.ipynb")):
        (course / "source" / path.stem).mkdir(parents=True)
        shutil.copy(path, course / "source" / path.stem / path.name)
    config = Config()
    config.CourseDirectory.root = str(course)
    config.CourseDirectory.course_id = "fsdp_lab"
    config.ExecutePreprocessor.timeout = 600
    api = NbGraderAPI(config=config)
    for path in sorted(FOLDER.glob("*.ipynb")):
        done = api.generate_assignment(path.stem, force=True)
        assert done["success"], done.get("log", "") + done.get("error", "")
        released = nbformat.read(course / "release" / path.stem / path.name, as_version=4)
        learner = [c for c in released.cells if c.metadata.get("nbgrader", {}).get("solution")]
        assert learner and all("raise NotImplementedError()" in c.source for c in learner)
    # A learner solves the first exercise of the collectives notebook and leaves the others:
    # autograde scores exactly the first one's points.
    stem = COLLECTIVES.stem
    nb = nbformat.read(course / "release" / stem / COLLECTIVES.name, as_version=4)
    first = LABS["collectives"][0]
    body = CORRECT_PY.split("def all_reduce_mean(tensor, group):\n", 1)[1].strip()
    nb = fill(nb, {first.name: "import torch.distributed as dist\n    " + body})
    (course / "submitted" / "alice" / stem).mkdir(parents=True)
    nbformat.write(nb, course / "submitted" / "alice" / stem / COLLECTIVES.name)
    # Mallory solves nothing and replaces the checks with no-ops in her solution cell: the
    # autograded cells reload the checks as installed, and she scores nothing.
    cheat = "".join(  # top-level lines after the stub's body
        f"\nexercises.check_{e.name} = lambda *a, **k: None" for e in LABS["collectives"]
    )
    nb = nbformat.read(course / "release" / stem / COLLECTIVES.name, as_version=4)
    nb = fill(nb, {first.name: "raise NotImplementedError()" + cheat})
    (course / "submitted" / "mallory" / stem).mkdir(parents=True)
    nbformat.write(nb, course / "submitted" / "mallory" / stem / COLLECTIVES.name)
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        gb.add_student("alice")
        gb.add_student("mallory")
    for student in ("alice", "mallory"):
        done = api.autograde(stem, student, force=True, create=True)
        assert done["success"], done.get("log", "") + done.get("error", "")
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        sub = gb.find_submission(stem, "alice")
        assert (sub.score, sub.max_score) == (
            first.points,
            sum(e.points for e in LABS["collectives"]),
        )
        assert gb.find_submission(stem, "mallory").score == 0


# The whole gallery of one lab from the command line (10 s here): each bug is caught in its
# exercise's tests, the report's text is tested below; the whole run is end-to-end.
@pytest.mark.e2e
def test_bugs_lists_every_bug_caught_beside_the_correct_run(tmp_path):
    proc = run("bugs", "--lab", "collectives", "--json", "--out", "gallery", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    bugs = json.loads(proc.stdout)["bugs"]
    expected = [b.slug for e in LABS["collectives"] for b in e.bugs]
    assert [b["bug"] for b in bugs] == expected
    assert all(b["caught"] and b["correct"]["passed"] for b in bugs)
    assert (tmp_path / "gallery" / "bugs.json").exists()
    assert list((tmp_path / "gallery").glob("*.png"))


def test_bugs_with_an_unknown_lab_is_one_line_and_the_fix(tmp_path):
    proc = run("bugs", "--lab", "sharding", cwd=tmp_path)
    assert proc.returncode == 2
    assert "lab 'sharding' has no bugs in the gallery: did you mean 'shard'?" in proc.stderr


def test_the_teaching_guide_tables_are_current_and_time_every_exercise():
    import importlib.util

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("tt", root / "scripts/doc_tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    assert tables.main(["--check"]) == 0, "fix: python scripts/doc_tables.py"
    doc = (root / "docs" / "teaching.md").read_text()
    timed = doc.split("<!-- generated: times", 1)[1].split("<!-- end generated -->", 1)[0]
    for group in LABS.values():
        for ex in group:
            assert f"| `{ex.name}` |" in timed, f"{ex.name} has no measured check time"


def test_the_gallery_ends_with_a_tally_and_names_where_pieces_came_from():
    from fsdp_lab.collectives.exercises.gather_shards import _order
    from fsdp_lab.course import gallery
    from fsdp_lab.course.verdict import Verdict
    from fsdp_lab.exercise import Bug

    ok = Verdict("x", "passed", "", 2)
    bug = Bug("b", "a bug", lambda: None, "it shows")
    exhibits = [
        gallery.Exhibit("shard", "x", bug, ok, Verdict("x", "wrong result", "drifts", 2)),
        gallery.Exhibit("shard", "x", bug, ok, Verdict("x", "raised", "boom", 2)),
        gallery.Exhibit("tying", "x", bug, ok, ok),  # the check missed it
    ]
    text = gallery.text_report(exhibits, detail=True)
    assert text.endswith(
        "3 bugs in 2 labs: 2 caught by the checks, 1 not; 1 of them raised no error at all "
        "(only the comparison with the correct run shows them)."
    )
    assert _order([0, 1, -1]) == "rank 0, rank 1, none"  # was printed as [0, 1, -1]
    # Issue 39: a row for scale only (the store-all baseline) has no value with the bug, and
    # printed "... | with the bug " and nothing.
    scaled = Verdict("x", "wrong result", "grew", 2, rows=[("store-all, for scale", "9 KiB", "")])
    text = gallery.text_report([gallery.Exhibit("checkpoint", "x", bug, ok, scaled)], detail=True)
    assert "  store-all, for scale: 9 KiB\n" in text and "with the bug \n" not in text


def test_the_whole_gallery_is_one_line_per_bug_and_a_lab_its_blocks():
    """Issue 39: `fsdp-lab bugs` printed 273 lines (a block of rows per bug). The whole gallery is
    one line per bug, with what was measured, then the tally; one lab (`--lab`) keeps each bug's
    rows and fix."""
    from fsdp_lab.course import gallery
    from fsdp_lab.course.verdict import Verdict
    from fsdp_lab.exercise import Bug

    ok = Verdict("x", "passed", "", 2)
    rows = [("gradient, first values", "0.5", "1.0"), ("loss after 3 steps", "1.2", "1.9")]
    wrong = Verdict("x", "wrong result", "the gradient is 2x", 2, rows=rows, hint="divide by N")
    bug = Bug("b", "SUM where the average was meant", lambda: None, "it shows")
    exhibits = [gallery.Exhibit(lab, "x", bug, ok, wrong) for lab in ("shard", "shard", "tying")]
    whole = gallery.text_report(exhibits).splitlines()
    assert len(whole) == len(exhibits) + 3, whole  # + a blank line, the tally, where the rest is
    assert whole[0] == "shard: SUM where the average was meant [x] — caught: the gradient is 2x"
    assert whole[-1] == "each bug's measured rows and fix: fsdp-lab bugs --lab LAB"
    # A verdict speaks to a learner; in the gallery it is said of the bug (a hostile review).
    yours = Verdict("x", "wrong result", "Your segments take more memory than yours should", 2)
    line = gallery.text_report([gallery.Exhibit("checkpoint", "x", bug, ok, yours)]).splitlines()[0]
    assert line.endswith("caught: The segments take more memory than the bug's should"), line
    one_lab = gallery.text_report(exhibits[:2], detail=True)
    assert "  gradient, first values: correct 0.5 | with the bug 1.0" in one_lab
    assert "  fix: divide by N" in one_lab


def test_a_graded_files_report_shows_the_table_its_hint_points_to():
    """A hostile review: `fsdp-lab grade` printed a failed verdict's hint ("the table above shows
    the first values that differ") without the table."""
    from fsdp_lab.course import gradebook
    from fsdp_lab.course.verdict import Verdict

    rows = [("averaged gradient, first values", "0.5, 0.25", "0, 0")]
    wrong = Verdict(
        "all_reduce_mean", "wrong result", "it differs", 2, rows=rows, hint="see the table above"
    )
    text = gradebook.text_report(
        [{"file": "a/ex.py", "student": "a", "verdicts": [wrong.to_dict()]}]
    )
    lines = text.splitlines()
    table = [i for i, line in enumerate(lines) if "0.5, 0.25 | 0, 0" in line]
    assert table and table[0] < [i for i, line in enumerate(lines) if "hint:" in line][0], text
    assert any(line.strip().startswith("expected | got") for line in lines), text
