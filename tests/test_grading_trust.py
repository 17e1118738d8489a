"""`fsdp-lab grade` as a hostile learner attacks it: a class of submissions, each trying to fake
its own grade, change another student's, break the whole run or outlive it — graded in one run
beside honest submissions. Every attack costs at most its own file's grade; the honest students
keep theirs. (The sandbox's own properties are asserted where bwrap can run: CI installs it.)"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from fsdp_lab.course.authoring import FOLDER, notebook_name
from fsdp_lab.course.sandbox import bwrap

FSDP_LAB = [sys.executable, "-m", "fsdp_lab"]
COLLECTIVES = FOLDER / notebook_name("collectives")
MARK = "fsdp_lab_test_daemon_mark"  # in the command line of a process a submission leaves
# A whole class graded in one run (one sandbox per file, 100 s here): an end-to-end run that CI
# makes after the suite (`pytest -m e2e`); the sandbox, limits and replies are tested one by one
# below, in the suite.
CLASS_RUN = pytest.mark.e2e

CORRECT = """\
import torch.distributed as dist
from fsdp_lab import comm


def all_reduce_mean(tensor, group):
    out = tensor.clone()
    comm.all_reduce(out, group=group)
    return out / dist.get_world_size(group)
"""

SUM_ONLY = """\
from fsdp_lab import comm


def all_reduce_mean(tensor, group):  # wrong: the sum, not the mean
    out = tensor.clone()
    comm.all_reduce(out, group=group)
    return out
"""

# A reply written straight to the grading process's fd 3, then an exit: what a learner who
# read the protocol can send (`extra`: one more line before the exercise's).
REPLY = """
import json, os
BIG = {{"first_grad": [10**400], "weights": [0.0], "losses": [0.0]}}
NESTED = {{"first_grad": [0.0], "weights": [0.0], "losses": [0.0]}}
for _ in range(400):
    NESTED = {{"losses": [NESTED]}}
os.write(3, (json.dumps({{"notes": [], "defined": ["all_reduce_mean"]}}) + "\\n").encode())
{extra}
os.write(3, (json.dumps({{"exercise": "all_reduce_mean", "runs": {runs}}}) + "\\n").encode())
os._exit(0)
"""
DEEP = 'os.write(3, ("[" * 200000 + "]" * 200000 + "\\n").encode())'

FULL_MARKS = [  # what the grading process used to print for a file that passed everything
    {"exercise": n, "kind": "passed", "summary": "", "points": 2, "score": 2, "passed": True}
    for n in ("all_reduce_mean", "gather_shards")
]


def notebook(cells: list[dict]) -> str:
    return json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


def code(source: str, **metadata: object) -> dict:
    return {"cell_type": "code", "source": source, "metadata": metadata, "outputs": []}


def write_class(root: Path, csv_path: Path) -> dict[str, Path]:
    """submitted/<student>/<file>: the honest ones and the attacks, keyed by student."""
    subs = root / "submitted"
    victim = subs / "zed" / "ex.py"  # graded last: the attacks aim at her file
    files = {
        # found by a hostile review: an empty file, done before the grader's reference ranks
        # were up, once made the grader kill them as if they were the submission's orphans
        "a_empty": ("ex.py", ""),
        "alice": ("ex.py", CORRECT),
        # 1 and 9. a full-marks line, then a verdict without points, on stdout; then an exit
        # before anything is checked
        "fake_line": (
            "ex.py",
            SUM_ONLY
            + textwrap.dedent(f"""
            import json, os
            print(json.dumps({{"file": __file__, "verdicts": {FULL_MARKS!r}}}), flush=True)
            print(json.dumps({{"file": __file__, "verdicts": [{{"exercise": "all_reduce_mean"}}]}}))
            os._exit(0)
            """),
        ),
        # 2, 3 and 4. every comparison made to say "equal", the verdict class made to say
        # "passed", and, on the rank, the group size the reference would read made 1
        "patcher": (
            "ex.py",
            textwrap.dedent("""
            import torch
            import torch.distributed as dist
            from fsdp_lab import comm
            from fsdp_lab.course.verdict import Verdict

            torch.allclose = lambda *a, **k: True
            Verdict.passed = property(lambda self: True)
            Verdict.score = property(lambda self: self.points)

            def all_reduce_mean(tensor, group):
                dist.get_world_size = lambda group=None: 1
                out = tensor.clone()
                comm.all_reduce(out, group=group)
                return out / dist.get_world_size(group)
            """),
        ),
        # 7 and 9. a row for another student, in the grading process's own format; a line that
        # is not JSON
        "forger": (
            "ex.py",
            SUM_ONLY
            + textwrap.dedent(f"""
            import json
            print(json.dumps({{"file": {str(subs / "alice" / "ex.py")!r}, "student": "alice",
                              "verdicts": [dict(v, score=0, passed=False, kind="raised")
                                           for v in {FULL_MARKS!r}]}}), flush=True)
            print("{{not json", flush=True)
            """),
        ),
        # 8 and 9. a process in a session of its own, waiting to rewrite the gradebook; another
        # student's submission deleted before she is graded
        "daemon": (
            "ex.py",
            CORRECT
            + textwrap.dedent(f"""
            import os, subprocess, sys
            subprocess.Popen([sys.executable, "-c", '''
            import os, sys, time
            for _ in range(600):
                time.sleep(0.1)
                if os.path.exists({str(csv_path)!r}):
                    time.sleep(1.0)
                    open({str(csv_path)!r}, "w").write("file,student,total\\\\nforged,alice,0\\\\n")
                    sys.exit()
            ''', "{MARK}"], start_new_session=True)
            os.remove({str(victim)!r})
            """),
        ),
        # 9 and 14. a notebook with odd cells (no source; nbgrader metadata that is a string),
        # and a correct solution whose cell mentions check_ in a comment
        "odd": (
            "ex.ipynb",
            notebook(
                [
                    {"cell_type": "code", "metadata": {}},
                    code("x = 1", nbgrader="x"),
                    code("# my answer to check_all_reduce_mean\n" + CORRECT),
                ]
            ),
        ),
        # 10. deletes everything in the folder grading was started in
        "wiper": (
            "ex.ipynb",
            notebook(
                [
                    code(CORRECT),
                    code(
                        textwrap.dedent("""
            import os, shutil
            for name in os.listdir("."):
                shutil.rmtree(name, ignore_errors=True)
                if os.path.exists(name):
                    os.remove(name)
            """)
                    ),
                ]
            ),
        ),
        # 12. a top-level loop that never ends
        "loop": ("ex.py", CORRECT + "while True:\n    pass\n"),
        # 13. 300 MB on stderr, then 20 GB asked for at once
        "hog": (
            "ex.py",
            CORRECT
            + textwrap.dedent("""
            import os
            chunk = b"x" * (1 << 20)
            for _ in range(300):
                os.write(2, chunk)
            hog = bytearray(20 << 30)
            """),
        ),
        # 15. a name a spreadsheet runs as a formula, and one with a right-to-left override (as
        # files of a kind that is not graded: their rows are made without running anything)
        '=HYPERLINK("x","y")': ("ex.txt", CORRECT),
        "evil\u202eyp.exe": ("ex.txt", CORRECT),
        # replies the grader once crashed on (a hostile review): nested past Python's stack, an
        # integer no float holds, curves nested 800 deep; and a message that rewrites the
        # terminal. Each reaches the judge on its own file (a verdict stops at the first case).
        "reply_deep": ("ex.py", REPLY.format(runs='[{"outcomes": [BIG, BIG]}]', extra=DEEP)),
        "reply_nested": ("ex.py", REPLY.format(runs='[{"outcomes": [NESTED] * 3}]', extra="")),
        "reply_ansi": (
            "ex.py",
            REPLY.format(
                runs='[{"failure": {"kind": "raised", "summary": "\\x1b[2J\\x1b[8mhidden"}}]',
                extra="",
            ),
        ),
        "zed": ("ex.py", CORRECT),
    }
    paths, paths_extra = {}, {}
    for student, (name, text) in files.items():
        path = subs / student / name
        path.parent.mkdir(parents=True)
        path.write_text(text)
        paths[student] = path
    # links to a peer's file: a symbolic one inside the folder, a hard one
    (subs / "peerlink").mkdir()
    (subs / "peerlink" / "mine.py").symlink_to(os.path.join("..", "alice", "ex.py"))
    (subs / "hardlink").mkdir()
    (root / "outside.py").write_text(CORRECT)
    if os.geteuid() == 0:  # a peer's file, hard-linked: the peer's, whatever folder it is in
        os.chown(root / "outside.py", 4242, 4242)
    os.link(root / "outside.py", subs / "hardlink" / "mine.py")
    (subs / "looper").mkdir()
    (subs / "looper" / "loop.py").symlink_to("loop.py")
    for who, name in (("peerlink", "mine.py"), ("hardlink", "mine.py"), ("looper", "loop.py")):
        paths_extra[who] = subs / who / name
    # 6. a relative symlink to the installed reference module
    import fsdp_lab.collectives.exercises.all_reduce_mean as reference

    (subs / "linker").mkdir()
    link = subs / "linker" / "ex.py"
    link.symlink_to(os.path.relpath(reference.__file__, link.parent))
    paths["linker"] = link
    # 9. a file name that is not valid UTF-8
    (subs / "bytes").mkdir()
    raw = os.path.join(os.fsencode(subs / "bytes"), b"caf\xe9.py")
    with open(raw, "w") as f:
        f.write(CORRECT)
    return {**paths, **paths_extra}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("course")
    (root / "gradebook.db").write_text("the course's gradebook")
    (root / "source").mkdir()
    csv_path = root / "grades.csv"
    paths = write_class(root, csv_path)
    command = [*FSDP_LAB, "grade", "submitted", "--only", "all_reduce_mean", "--time-limit", "8",
               "--json", "--csv", "grades.csv"]  # fmt: skip
    with subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as popen:  # fmt: skip
        peak = [0]  # the grading process's own resident memory, sampled while it runs

        def sample() -> None:
            with contextlib.suppress(psutil.Error):
                while popen.poll() is None:
                    peak[0] = max(peak[0], psutil.Process(popen.pid).memory_info().rss)
                    time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        out, err = popen.communicate(timeout=900)
        sampler.join()
    proc = subprocess.CompletedProcess(command, popen.returncode, out, err)
    print(err[-4000:], f"\npeak RSS of the grading process: {peak[0] >> 20} MiB")
    time.sleep(3.0)  # time for a process left behind to do its worst
    rows = list(csv.DictReader(csv_path.open(encoding="utf-8"))) if csv_path.exists() else []
    return root, paths, proc, rows, peak[0]


def by_student(proc) -> dict[str, dict]:
    return {r["student"]: r for r in json.loads(proc.stdout)["submissions"]}


def score(result: dict) -> int | None:
    return None if "error" in result else sum(v["score"] for v in result["verdicts"])


@CLASS_RUN
def test_grading_completes_with_one_row_per_file(graded):
    root, paths, proc, rows, _ = graded
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)["submissions"]
    assert len(results) == len(rows) == len(paths) + 1  # + the non-UTF-8 name
    honest = by_student(proc)
    assert score(honest["alice"]) == 2 and score(honest["zed"]) == 2


@CLASS_RUN
def test_no_attack_gets_points_it_did_not_earn(graded):
    _, _, proc, _, _ = graded
    got = by_student(proc)
    for who in ("fake_line", "patcher", "forger"):
        assert (score(got[who]) or 0) == 0, (who, got[who])  # an error row scores nothing
    for who in ("linker", "peerlink", "looper"):  # links: to a peer, to anything
        assert "link" in got[who]["error"] and "refused" in got[who]["error"], got[who]
    if os.geteuid() == 0:  # a hard link to another user's file: refused by its owner
        assert "owned by user 4242" in got["hardlink"]["error"], got["hardlink"]
    for who, kind in (("reply_deep", "invalid reply"), ("reply_nested", "invalid reply"),
                      ("reply_ansi", "raised")):  # fmt: skip
        verdict = got[who]["verdicts"][0]
        assert (verdict["kind"], verdict["score"]) == (kind, 0), got[who]
    assert "\\x1b[2J" in got["reply_ansi"]["verdicts"][0]["summary"]  # escaped, never run
    assert score(got["a_empty"]) is None and "defines none" in got["a_empty"]["error"]


@CLASS_RUN
def test_a_submission_cannot_change_another_students_row(graded):
    _, _, proc, rows, _ = graded
    students = [r["student"] for r in rows]
    assert students.count("alice") == 1
    alice = next(r for r in rows if r["student"] == "alice")
    assert (alice["all_reduce_mean"], alice["total"]) == ("2", "2")
    assert not [p for p in psutil.process_iter(["cmdline"]) if MARK in " ".join(
        p.info["cmdline"] or [])]  # fmt: skip


@CLASS_RUN
def test_odd_files_and_names_are_their_own_rows(graded):
    root, _, proc, rows, _ = graded
    got = by_student(proc)
    assert score(got["odd"]) == 2  # odd cells skipped; its check_ comment hid nothing
    assert score(got["zed"]) == 2  # deleted by another submission before her turn: graded
    assert score(got["bytes"]) == 2
    undecodable = next(r for r in rows if r["student"] == "bytes")["file"]
    assert undecodable.endswith("caf\\xe9.py")
    # Names are printed, never run: no formula cell, no raw control character.
    assert all(not r["student"].startswith("=") for r in rows)
    assert '\'=HYPERLINK("x","y")' in [r["student"] for r in rows]
    assert "evil\\u202eyp.exe" in [r["student"] for r in rows]
    assert "\u202e" not in proc.stdout + proc.stderr + (root / "grades.csv").read_text()


@CLASS_RUN
def test_the_course_folder_survives_a_submission_that_wipes_its_folder(graded):
    root, _, proc, _, _ = graded
    assert (root / "gradebook.db").read_text() == "the course's gradebook"
    assert (root / "source").is_dir() and (root / "submitted" / "alice" / "ex.py").exists()
    assert score(by_student(proc)["wiper"]) == 2


@CLASS_RUN
def test_limits_stop_a_loop_a_flood_and_a_hog(graded):
    _, _, proc, _, peak = graded
    got = by_student(proc)
    assert any("ran past 8 s" in n for n in got["loop"]["notes"]), got["loop"]
    assert score(got["loop"]) == 2  # its function still graded after the loop was stopped
    assert peak < 400 << 20, f"the grader held {peak >> 20} MiB"  # 300 MB on stderr: not kept
    assert score(got["hog"]) == 2 and any("MemoryError" in n for n in got["hog"]["notes"])


@pytest.mark.parametrize(
    "where",
    # A folder others may write without the sticky bit (they could swap the gradebook), a
    # link at the gradebook's name (root replaced /dev/stdout with a file), /dev/fd/1: found
    # by a hostile review.
    ["folder", "missing/grades.csv", "shared/grades.csv", "link.csv", "/dev/fd/1"],
)
def test_a_csv_that_cannot_be_written_is_refused_before_grading(tmp_path, where):
    (tmp_path / "folder").mkdir()
    (tmp_path / "shared").mkdir()
    os.chmod(tmp_path / "shared", 0o777)
    (tmp_path / "target.csv").write_text("")
    (tmp_path / "link.csv").symlink_to(tmp_path / "target.csv")
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "ex.py").write_text(CORRECT)
    proc = subprocess.run(
        [*FSDP_LAB, "grade", "s", "--csv", where], cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "[1/" not in proc.stderr  # refused before the first file
    assert "--csv" in proc.stderr and "hint:" in proc.stderr


def test_importing_the_course_tools_starts_no_process():
    code = (
        "import psutil, fsdp_lab, fsdp_lab.cluster, fsdp_lab.course, fsdp_lab.cli\n"
        "print(len(psutil.Process().children()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "0", out.stderr


@pytest.mark.skipif(bwrap() is None, reason="bubblewrap cannot run here (CI installs it)")
def test_the_sandbox_sees_no_course_folder_no_network_and_no_other_process(tmp_path):
    from fsdp_lab.course import sandbox

    probe = textwrap.dedent(f"""
        import ctypes, json, os, socket
        shmget = ctypes.CDLL(None, use_errno=True).shmget
        seen = {{
            "shm": shmget(0, 64 << 20, 0o1600),  # IPC_PRIVATE, IPC_CREAT: 64 MiB
            "course": os.path.exists({str(tmp_path)!r}),
            "cwd": sorted(os.listdir(".")),
            "uid": os.getuid(),
            "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
            "interfaces": sorted(n for _, n in socket.if_nameindex()),
        }}
        os.write(3, json.dumps(seen).encode())
        """)
    (tmp_path / "probe.py").write_text(probe)
    run = sandbox.run_submission(
        tmp_path / "probe.py", "probe.py", ["probe.py"], sandbox.Limits(wall_seconds=60), 1 << 20
    )
    seen = json.loads(run.reply)
    assert seen["course"] is False and seen["cwd"] == ["probe.py"]
    assert seen["interfaces"] == ["lo"]
    assert len(seen["pids"]) <= 3  # bwrap's init, the probe (and bwrap's monitor)
    if os.geteuid() == 0:  # a user of the sandbox's own, never root
        assert seen["uid"] >= 200_000 or seen["uid"] == 65534
        assert seen["shm"] == -1  # System V shared memory, which no rlimit counts, is capped


def test_without_bwrap_a_process_left_behind_is_found_and_killed(monkeypatch, tmp_path):
    """The fallback: no sandbox, but the limits, and nothing outlives the file (the grader is a
    child subreaper, so an orphan in a session of its own comes back to it and is killed)."""
    from fsdp_lab.course import sandbox

    monkeypatch.setattr(sandbox, "bwrap", lambda: None)
    assert "not available" in sandbox.sandbox_note()
    probe = textwrap.dedent("""
        import os, subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session=True)
        os.write(3, str(child.pid).encode())
        hog = None
        try:
            hog = bytearray(20 << 30)
        except MemoryError:
            os.write(3, b" MemoryError")
        """)
    (tmp_path / "probe.py").write_text(probe)
    helpers = {launcher_pid() for _ in [0]}
    run = sandbox.run_submission(
        tmp_path / "probe.py", "probe.py", ["probe.py"], sandbox.Limits(wall_seconds=60), 1 << 20
    )
    pid, said = run.reply.decode().split(" ", 1)
    assert said == "MemoryError"  # the address-space limit holds without the sandbox too
    time.sleep(0.5)
    assert not psutil.pid_exists(int(pid)) or psutil.Process(int(pid)).status() == "zombie"
    # the grader's own helpers (the fork server its reference ranks come from) were spared
    assert all(psutil.pid_exists(p) for p in helpers | {launcher_pid()} if p)


def launcher_pid() -> int | None:
    from fsdp_lab.cluster import launcher

    return launcher.server_pid()


def test_a_reply_is_read_within_bounds_whatever_it_holds():
    from fsdp_lab.course.grading import MAX_NOTES, NOTE_CHARS, read_reply
    from fsdp_lab.course.sandbox import Run

    def run(reply: bytes) -> Run:
        return Run(0, 1.0, "", "", reply)

    flood = b"\n" * 30_000_000 + b'{"notes": [], "defined": ["x"]}\n'
    assert "defined" not in read_reply(run(flood))  # only the first lines are read
    note = json.dumps({"notes": ["\x1b[2J" + "n" * 1_000_000] * (MAX_NOTES + 5), "defined": []})
    notes = read_reply(run(note.encode()))["notes"]
    assert len(notes) == MAX_NOTES and all(len(n) <= NOTE_CHARS for n in notes)
    assert all("\x1b" not in n for n in notes)


def test_a_path_the_system_cannot_take_is_a_row_not_a_crash(tmp_path):
    from fsdp_lab.course.roster import submissions

    (row,) = submissions([tmp_path / ("x" * 5000 + ".py")], tmp_path)
    assert row.copy is None and "name too long" in row.error.lower()


@pytest.mark.skipif(bwrap() is None, reason="bubblewrap cannot run here (CI installs it)")
def test_a_python_or_checkout_under_tmp_is_still_seen_inside_the_sandbox(tmp_path):
    """Found by a fresh clone in /tmp: the sandbox's private /tmp was mounted after the Python
    paths it binds, hid those under /tmp, and every submission of the class scored 0 (it could
    not import fsdp_lab). The binds go on top of the private /tmp now."""
    from fsdp_lab.course import sandbox

    assert str(tmp_path).startswith("/tmp/")  # pytest's folders: the case itself
    (tmp_path / "seen.txt").write_text("the checkout")
    command = [bwrap(), *sandbox._mounts([str(tmp_path)]), "cat", str(tmp_path / "seen.txt")]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert out.stdout == "the checkout", out.stderr


# -- round two (issue 35): text, forged figures, a neighbour's folder, limits per sandbox -----

SHARD_AND_CHECKPOINT = """\
import math


def free_unsharded(buffer):
    buffer.untyped_storage().resize_(0)


def unit_to_prefetch(forward_order, position):
    return forward_order[position - 1] if position > 0 else None


def sqrt_segment_starts(n_layers):
    k = max(1, round(math.sqrt(n_layers)))
    return list(range(0, n_layers, k))
"""

SQRT_ONLY = (
    SHARD_AND_CHECKPOINT.split("def free_unsharded")[0]
    + (
        SHARD_AND_CHECKPOINT.split(
            "return forward_order[position - 1] if position > 0 else None\n"
        )[1]
    )
)

# Wrong code, and a few lines that rewrite what its run reports about itself: nothing held, no
# all-gathers, no layer calls. The trial's own result is replaced on its way to the reply.
FORGE = """
import fsdp_lab.course.checker as _checker
_run_case = _checker.run_case


def _forged(exercise, fn, case, pool):
    run = _run_case(exercise, fn, case, pool)
    for o in run.get("outcomes", []):
        if "markers" in o:
            o["markers"] = [[label, 0] for label, _ in o["markers"]]
            o["held"] = [[unit, "0 bytes (freed)"] for unit, _ in o["held"]]
        if "peak_gathered" in o:
            o.update(gathers=[], on_demand=[], peak_gathered=0)
            o["gathered_at_markers"] = [0 for _ in o["gathered_at_markers"]]
        if "segments" in o:
            o["segments"].update(peak=0, calls=0)
    return run


_checker.run_case = _forged
"""
WRONG = {
    "free_unsharded": "def free_unsharded(buffer):\n    del buffer\n",
    "unit_to_prefetch": (
        "def unit_to_prefetch(forward_order, position):\n    return forward_order[position]\n"
    ),
    "sqrt_segment_starts": "def sqrt_segment_starts(n_layers):\n    return [0]\n",
}


MESH_GROUPS_UNNAMED = """\
def _groups(world_size, shard_size):
    r = world_size // shard_size
    return ([[i * shard_size + s for s in range(shard_size)] for i in range(r)],
            [[i * shard_size + s for i in range(r)] for s in range(shard_size)])


globals()["mesh" + "_groups"] = _groups
"""
HAND_OVER_FORGED = """\
import json, os
o = {"stage": 0, "dp": 0, "layers": [0], "values": [["w", [1.0, 1.0]]], "one_process": [],
     "messages": 0}
os.write(3, (json.dumps({"notes": [], "defined": ["hand_over"]}) + "\\n").encode())
os.write(3, (json.dumps({"exercise": "hand_over", "runs": [{"outcomes": [o, o]}]}) + "\\n").encode())
os._exit(0)
"""


def write_second_class(root: Path) -> Path:
    subs = root / "checkout" / "course" / "submitted"
    alice = subs / "alice" / "ex.py"
    files = {
        ("alice", "ex.py"): SHARD_AND_CHECKPOINT,
        # 7. a name that starts like an option
        ("dash", "-v2.py"): SQRT_ONLY,
        # 1. a lone surrogate: raised at top level, raised on a rank, written as a reply
        ("sur_top", "ex.py"): SQRT_ONLY + 'raise ValueError("\\ud800")\n',
        ("sur_rank", "ex.py"): 'def sqrt_segment_starts(n_layers):\n    raise ValueError("x\\ud800")\n',
        ("sur_reply", "ex.py"): 'import os\nos.write(3, b\'{"error": "\\\\ud800"}\\n\')\nos._exit(0)\n',
        # 3. a neighbour's file, by its path (the checkout is on PYTHONPATH)
        ("peeker", "ex.py"): SQRT_ONLY + f"raise RuntimeError('saw:' + str(__import__('os').path.exists({str(alice)!r})))\n",
        # 6. one student's many files
        **{("many", f"{c}.py"): "" for c in "abcdef"},
        # found by a hostile review: a replayed exercise no file names (its reference was never
        # started, and the KeyError stopped the class as the grader's error); outcomes that make
        # a judge raise what no list of malformed-data errors held (StopIteration); an error
        # reply worded as the grader's own
        ("sneaky", "ex.py"): MESH_GROUPS_UNNAMED,
        ("carol", "ex.py"): HAND_OVER_FORGED,
        ("ivan", "ex.py"): 'import os\nos.write(3, b\'{"error": "grader error on this file"}\\n\')\nos._exit(0)\n',
    }  # fmt: skip
    for name, wrong in WRONG.items():  # 2. wrong code + forged figures
        files[(f"forge_{name}", "ex.py")] = wrong + FORGE
    for (student, name), text in files.items():
        path = subs / student / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return subs


@pytest.fixture(scope="module")
def graded_again(tmp_path_factory):
    root = tmp_path_factory.mktemp("course2")
    subs = write_second_class(root)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "checkout"), *sys.path])}
    command = [*FSDP_LAB, "grade", str(subs), "--time-limit", "8", "--json",
               "--max-files-per-student", "2", "--csv", str(root / "grades.csv")]  # fmt: skip
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, timeout=900)
    print(proc.stderr.decode(errors="replace")[-4000:])
    return root, proc


@CLASS_RUN
def test_a_lone_surrogate_costs_nothing_but_its_own_file(graded_again):
    root, proc = graded_again
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = by_student(proc)
    assert score(got["alice"]) == 6
    assert score(got["sur_top"]) == 2  # its function is still graded
    assert any("\\ud800" in n for n in got["sur_top"]["notes"])
    (v,) = [v for v in got["sur_rank"]["verdicts"] if v["exercise"] == "sqrt_segment_starts"]
    assert v["kind"] == "raised" and "\\ud800" in v["summary"]
    assert "\\ud800" in got["sur_reply"]["error"]
    rows = list(csv.DictReader((root / "grades.csv").open(encoding="utf-8")))
    assert {"alice", "sur_top", "sur_rank", "sur_reply"} <= {r["student"] for r in rows}


@CLASS_RUN
def test_forged_figures_with_wrong_code_score_nothing(graded_again):
    _, proc = graded_again
    got = by_student(proc)
    for name in WRONG:
        (v,) = [v for v in got[f"forge_{name}"]["verdicts"] if v["exercise"] == name]
        assert v["score"] == 0 and v["kind"] in ("wrong result", "invalid reply"), v


@CLASS_RUN
def test_what_a_submission_sends_is_its_own_row_never_the_graders_error(graded_again):
    _, proc = graded_again
    got = by_student(proc)
    assert json.loads(proc.stdout)["grader_errors"] == 0
    (v,) = [v for v in got["sneaky"]["verdicts"] if v["exercise"] == "mesh_groups"]
    assert v["passed"], v  # replayed, though no file named it
    (v,) = [v for v in got["carol"]["verdicts"] if v["exercise"] == "hand_over"]
    assert (v["kind"], v["score"]) == ("invalid reply", 0), v
    assert got["ivan"]["error"].startswith("the submission's process said: grader error")


@CLASS_RUN
def test_a_file_named_like_an_option_is_graded(graded_again):
    _, proc = graded_again
    assert score(by_student(proc)["dash"]) == 2


@CLASS_RUN
def test_the_sandbox_binds_no_folder_that_holds_submissions(graded_again):
    root, proc = graded_again
    got = by_student(proc)
    assert any("saw:False" in n for n in got["peeker"]["notes"]), got["peeker"]
    seen = json.loads(proc.stdout)["sandbox"]
    subs = str(root / "checkout" / "course")
    assert seen["binds"] and not any(subs.startswith(b.rstrip("/") + "/") for b in seen["binds"])


@CLASS_RUN
def test_one_student_cannot_stall_the_class(graded_again):
    _, proc = graded_again
    results = json.loads(proc.stdout)["submissions"]
    many = [r for r in results if r["student"] == "many"]
    assert len(many) == 6
    skipped = [r for r in many if "not graded" in r.get("error", "")]
    assert len(skipped) == 4 and all("2 files per student" in r["error"] for r in skipped)
    # fair order: every other student's file was graded before the second of "many"
    order = [r["student"] for r in results if "not graded" not in r.get("error", "")]
    second = [i for i, s in enumerate(order) if s == "many"][1]
    assert second == len(order) - 1, order


def test_an_error_on_the_graders_side_blames_no_student(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "ex.py").write_text(CORRECT)
    env = {**os.environ, "FSDP_LAB_DEVICE": "garbage"}
    proc = subprocess.run([*FSDP_LAB, "grade", "s", "--json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "[1/" not in proc.stderr and "garbage" in proc.stderr
    assert "submissions" not in json.loads(proc.stdout)


def test_a_reference_that_fails_mid_run_stops_grading_as_the_graders_error():
    from fsdp_lab.course.grading import GraderError, Judge

    judge = Judge()
    try:
        judge._futures["x"] = broken = __import__("concurrent.futures").futures.Future()
        broken.set_exception(RuntimeError("the reference solution of x failed"))
        with pytest.raises(GraderError, match="reference"):
            judge.reference(__import__("types").SimpleNamespace(name="x"))
    finally:
        judge.close()


def test_a_path_that_does_not_exist_is_wrong_input(tmp_path):
    proc = subprocess.run([*FSDP_LAB, "grade", "nosuch/"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "nosuch" in proc.stderr, proc.stderr


@pytest.mark.skipif(bwrap() is None, reason="bubblewrap cannot run here (CI installs it)")
@pytest.mark.parametrize("how", ["as the machine allows", "watchdog"])
def test_memory_is_limited_for_the_sandbox_as_a_whole(tmp_path, monkeypatch, how):
    """Under an address-space limit per process, four children and two memfds held twice the
    limit. The sandbox as a whole is limited now: a control group where root may make one
    (as here and in CI), else a watchdog summing its processes and their memfds."""
    from fsdp_lab.course import sandbox

    if how == "watchdog":
        monkeypatch.setattr(sandbox.ControlGroup, "make", classmethod(lambda cls, *a: None))

    probe = textwrap.dedent("""
        import ctypes, os, time
        MiB = 1 << 20
        fds = [os.memfd_create("hoard") for _ in range(2)]  # under the file-size limit each
        for fd in fds:
            for _ in range(60):
                os.write(fd, b"y" * MiB)
        os.write(3, b"memfd ")
        children = []
        for k in range(4):
            pid = os.fork()
            if pid == 0:
                hold = (ctypes.c_char * (150 * MiB))()
                ctypes.memset(hold, 1, 150 * MiB)  # every page touched: resident
                os.write(3, f"child{k} ".encode())
                time.sleep(30)
                os._exit(0)
            children.append(pid)
            time.sleep(1.0)
        time.sleep(3)
        alive = sum(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in children)
        os.write(3, f"alive={alive}".encode())
        """)
    (tmp_path / "probe.py").write_text(probe)
    limits = sandbox.Limits(wall_seconds=60, memory_bytes=400 << 20)
    run = sandbox.run_submission(tmp_path / "probe.py", "probe.py", ["probe.py"], limits, 1 << 20)
    said = (run.reply or b"").decode()
    assert said.startswith("memfd child0"), (said, run.stderr[-2000:])  # ran, then was stopped
    # 120 MiB of memfds and 150 MiB per child: within 400 MiB, one child at most holds on
    assert run.limit_hit == "memory" and "alive=2" not in said and "alive=3" not in said, said
    assert "memory" in sandbox.sandbox_note(limits)


@pytest.mark.skipif(bwrap() is None, reason="bubblewrap cannot run here (CI installs it)")
def test_one_sandbox_s_processes_do_not_starve_another(tmp_path):
    """Every sandbox ran as one user, and the process limit was that user's: one submission's
    threads made a concurrent sandbox fail to start its own. The limit is per sandbox now."""
    from fsdp_lab.course import sandbox

    probe = textwrap.dedent("""
        import os, threading, time
        started = 0
        try:
            for _ in range(300):
                threading.Thread(target=time.sleep, args=(8,), daemon=True).start()
                started += 1
        except RuntimeError:
            pass
        os.write(3, str(started).encode())
        time.sleep(4)
        """)
    (tmp_path / "probe.py").write_text(probe)
    limits = sandbox.Limits(wall_seconds=60, processes=400)
    runs: list = []

    def one() -> None:
        runs.append(sandbox.run_submission(tmp_path / "probe.py", "probe.py", ["probe.py"], limits,
                                           1 << 20))  # fmt: skip

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(2.0)
    for t in threads:
        t.join()
    assert sorted(int(r.reply or b"0") for r in runs) == [300, 300], [r.stderr[-500:] for r in runs]


def test_the_class_time_limit_leaves_rows_not_a_stall(tmp_path):
    for who in ("ann", "bob", "cid"):
        (tmp_path / "s" / who).mkdir(parents=True)
        (tmp_path / "s" / who / "ex.py").write_text("x = 1\n")
    proc = subprocess.run([*FSDP_LAB, "grade", "s", "--json", "--class-time-limit", "0.5"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["submissions"]
    assert "defines none" in rows[0]["error"]  # the first file starts within the limit
    assert [r["student"] for r in rows] == ["ann", "bob", "cid"]
    assert all("class time limit (0.5 s)" in r["error"] for r in rows[1:]), rows
    assert "at most in all (class time limit 0.5 s)" in proc.stderr


def test_students_are_graded_in_turns_up_to_their_cap(tmp_path):
    from fsdp_lab.course.roster import fair_order, submissions

    for who, files in (("a", "xyz"), ("b", "xy")):
        for k in files:
            (tmp_path / "s" / who).mkdir(parents=True, exist_ok=True)
            (tmp_path / "s" / who / f"{k}.py").write_text("x = 1\n")
        (tmp_path / "s" / who / "timestamp.txt").write_text("nbgrader's")  # never a row
        (tmp_path / "s" / who / "notes.md").write_text("a row, not counted in the cap")
    (tmp_path / "snap").mkdir()
    order = fair_order(submissions([tmp_path / "s"], tmp_path / "snap", max_files=2))
    graded = [o.shown.split("/s/")[1] for o in order if o.copy is not None]
    assert graded == ["a/x.py", "b/x.py", "a/y.py", "b/y.py"]
    over = [o.shown.split("/s/")[1] for o in order if o.error and "more than 2" in o.error]
    assert over == ["a/z.py"]
    assert len(list((tmp_path / "snap").iterdir())) == 4  # past the cap: never copied
    assert sum("notes.md" in o.shown for o in order) == 2


def test_a_grader_error_on_one_file_is_its_row_and_the_others_are_graded(tmp_path, monkeypatch):
    """Point 1's rule for whatever the grader itself gets wrong on one file's reply: that
    file's row says so (the grader's error, not the student's), every other file is graded."""
    from fsdp_lab.course import grading

    for who, text in (("ann", CORRECT), ("bob", CORRECT)):
        (tmp_path / who).mkdir()
        (tmp_path / who / "ex.py").write_text(text)
    verdicts = grading.Judge.verdicts

    def fails_on_ann(self, reply, run, only, sub):
        if sub.student == "ann":
            raise KeyError("a bug of the grader's")
        return verdicts(self, reply, run, only, sub)

    monkeypatch.setattr(grading.Judge, "verdicts", fails_on_ann)
    graded = grading.grade_paths([tmp_path], 8.0, "all_reduce_mean")
    rows = {r["student"]: r for r in graded["submissions"]}
    assert graded["grader_errors"] == 1
    assert rows["ann"]["error"].startswith("grader error on this file")
    assert score(rows["bob"]) == 2


def test_several_folders_named_keep_their_students_apart(tmp_path):
    """Found by a hostile review: `fsdp-lab grade submitted/*` made every student's "ps1/" one
    student "ps1" (and the cap per student then skipped most of the class, exit 0)."""
    from fsdp_lab.course.roster import submissions

    for who in ("alice", "bob"):
        (tmp_path / "submitted" / who / "ps1").mkdir(parents=True)
        (tmp_path / "submitted" / who / "ps1" / "ps1.py").write_text(CORRECT)
    (tmp_path / "snap").mkdir()
    roots = sorted((tmp_path / "submitted").iterdir())
    students = [s.student for s in submissions(roots, tmp_path / "snap")]
    assert students == ["alice/ps1", "bob/ps1"]
    (tmp_path / "snap2").mkdir()
    whole = {s.student for s in submissions([tmp_path / "submitted"], tmp_path / "snap2")}
    assert whole == {"alice", "bob"}
    # One assignment of each (`submitted/*/ps1`): each named by the end of its path that tells
    # it apart, not all "ps1/ps1" (a hostile review: the whole class was one student).
    (tmp_path / "snap3").mkdir()
    ps1 = sorted((tmp_path / "submitted").glob("*/ps1"))
    assert [s.student for s in submissions(ps1, tmp_path / "snap3")] == ["alice/ps1", "bob/ps1"]


def test_a_hidden_python_file_gets_a_row_and_jupyters_folders_none(tmp_path):
    from fsdp_lab.course.roster import submissions

    (tmp_path / "s" / "hank" / ".ipynb_checkpoints").mkdir(parents=True)
    (tmp_path / "s" / "hank" / ".ipynb_checkpoints" / "ex-checkpoint.py").write_text(CORRECT)
    (tmp_path / "s" / "hank" / "__draft.py").write_text(CORRECT)
    (tmp_path / "snap").mkdir()
    (row,) = submissions([tmp_path / "s"], tmp_path / "snap")
    assert row.copy is None and "hidden file" in row.error and "rename" in row.error


def test_a_notebook_line_that_is_not_text_is_left_out(tmp_path):
    from fsdp_lab.course.submission import code_cells

    nb = {"cells": [{"cell_type": "code", "metadata": {},
                     "source": ["def f(t, g):\n", 5, "    return t\n"]}], "nbformat": 4}  # fmt: skip
    (tmp_path / "x.ipynb").write_text(json.dumps(nb))
    assert code_cells(tmp_path / "x.ipynb") == ["def f(t, g):\n    return t\n"]


def test_a_typo_in_a_grade_option_points_at_grades_own_help(tmp_path):
    proc = subprocess.run([*FSDP_LAB, "grade", "s", "--time-limt", "8"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert "--time-limt -> --time-limit" in proc.stderr
    assert "fsdp-lab grade --help" in proc.stderr


# -- outputs: the gradebook is written new, whole and the grader's own (issue 51) --------------

ROWS = [{"file": "a.py", "student": "alice", "verdicts": [
    {"exercise": "all_reduce_mean", "score": 2, "points": 2}]}]  # fmt: skip


def _written(path: Path) -> os.stat_result:
    info = path.lstat()
    assert path.is_file() and not path.is_symlink()
    assert info.st_uid == os.geteuid()
    assert oct(info.st_mode & 0o777) == oct(0o666 & ~_umask()), "not the mode open() gives"
    assert "alice" in path.read_text()
    return info


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_link_planted_at_the_gradebooks_temporary_name_is_never_written_through(tmp_path):
    """Item 2: the CSV overwrote the target of a link planted at `.grades.csv.partial`."""
    from fsdp_lab.course.gradebook import write_csv

    victim = tmp_path / "gradebook.db"
    victim.write_text("precious")
    (tmp_path / ".grades.csv.partial").symlink_to(victim)
    write_csv(ROWS, tmp_path / "grades.csv")
    assert victim.read_text() == "precious"
    _written(tmp_path / "grades.csv")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root (CI grades as root)")
def test_a_file_planted_by_another_user_never_becomes_the_gradebook(tmp_path):
    """Item 2: another user's 0666 file at the temporary name became grades.csv, theirs."""
    from fsdp_lab.course.gradebook import write_csv

    planted = tmp_path / ".grades.csv.partial"
    planted.write_text("")
    os.chmod(planted, 0o666)
    os.chown(planted, 4242, 4242)
    write_csv(ROWS, tmp_path / "grades.csv")
    _written(tmp_path / "grades.csv")


def test_a_folder_planted_at_the_temporary_name_costs_no_gradebook(tmp_path):
    """Own case: the write at the end of grading failed (a folder where the temporary file
    went), after the whole class was graded."""
    from fsdp_lab.course.gradebook import write_csv

    (tmp_path / ".grades.csv.partial").mkdir()
    write_csv(ROWS, tmp_path / "grades.csv")
    _written(tmp_path / "grades.csv")


def test_a_lab_output_planted_as_a_link_is_replaced_not_written_through(tmp_path):
    """Own case: `--out`: a link planted at a lab's JSON or figure name overwrote its target."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from fsdp_lab.plots import save_figure

    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "memory.png").symlink_to(victim)
    fig = Figure()
    fig.add_subplot().plot([0, 1])
    save_figure(fig, tmp_path / "out" / "memory.png")
    assert victim.read_text() == "precious"
    assert (tmp_path / "out" / "memory.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "out" / "memory.png").is_symlink()


# -- resources: memory a submission holds in tmpfs counts against its limit (issue 51) ----------


@pytest.mark.skipif(bwrap() is None, reason="bubblewrap cannot run here (CI installs it)")
def test_the_sandboxs_shared_memory_is_private_and_bounded(tmp_path):
    """Item 5: /dev/shm in the sandbox was bwrap's own /dev folder (half the machine's RAM,
    writable by a grader that is not root): 720 MiB held under a 256 MiB limit. It is a
    tmpfs of its own now, of a bounded size, and /dev is read-only."""
    from fsdp_lab.course import sandbox

    probe = textwrap.dedent("""
        import json, os
        shm = os.statvfs("/dev/shm")
        try:
            open("/dev/hoard", "wb").close()
            dev = "writable"
        except OSError:
            dev = "read-only"
        os.write(3, json.dumps({"shm": shm.f_blocks * shm.f_frsize, "dev": dev}).encode())
        """)
    (tmp_path / "probe.py").write_text(probe)
    run = sandbox.run_submission(tmp_path / "probe.py", "probe.py", ["probe.py"],
                                 sandbox.Limits(wall_seconds=60), 1 << 20)  # fmt: skip
    seen = json.loads(run.reply)
    assert seen["shm"] <= sandbox.SHM_TMPFS_BYTES and seen["dev"] == "read-only", seen


@pytest.mark.skipif(bwrap() is None, reason="bubblewrap cannot run here (CI installs it)")
def test_files_in_the_sandboxs_tmpfs_count_against_its_memory(tmp_path, monkeypatch):
    """Own case: under the watchdog (no control group), 200 MiB in /tmp and 200 MiB in the
    working folder — tmpfs pages no process maps — passed a 256 MiB limit unseen."""
    from fsdp_lab.course import sandbox

    monkeypatch.setattr(sandbox.ControlGroup, "make", classmethod(lambda cls, *a: None))
    probe = textwrap.dedent("""
        import os, time
        held = 0
        for where in ("/tmp", "."):
            for k in range(4):  # files under the 64 MiB a file may hold
                with open(os.path.join(where, f"hoard{k}"), "wb") as f:
                    for _ in range(50):
                        f.write(b"z" * (1 << 20))
                        f.flush()
                        held += 1
        os.write(3, b"held all")
        time.sleep(5)
        """)
    (tmp_path / "probe.py").write_text(probe)
    limits = sandbox.Limits(wall_seconds=60, memory_bytes=256 << 20)
    run = sandbox.run_submission(tmp_path / "probe.py", "probe.py", ["probe.py"], limits, 1 << 20)
    assert run.limit_hit == "memory", (run.reply, run.stderr[-1000:])


# -- endings: SIGTERM and SIGHUP clean up as Ctrl-C does (issue 51) ------------------------------

LOOPS = "def all_reduce_mean(tensor, group):\n    return tensor\n\nwhile True:\n    pass\n"


def _cgroups_of_ours() -> list[str]:
    """Control groups a sandbox made (fsdp_lab_grade_*), in every hierarchy of this process."""
    left = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        for mount in ("/sys/fs/cgroup/" + n for n in (names.split(",") if names else ["unified"])):
            with contextlib.suppress(OSError):
                left += [e.name for e in Path(mount + path).iterdir()
                         if e.name.startswith("fsdp_lab_")]  # fmt: skip
    return left


def _descendants_of(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).children(recursive=True)
    return []


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.e2e)], ids=["TERM", "HUP"]
)
def test_a_grading_run_ended_by_a_signal_leaves_nothing_behind(tmp_path, sig):
    """Item 3: SIGTERM or SIGHUP (a CI timeout, a dropped ssh session) left copies of every
    student's file, the sandbox folder, the ranks' stores and two cgroups."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    for who in ("ann", "bob"):
        (tmp_path / "s" / who).mkdir(parents=True)
        (tmp_path / "s" / who / "ex.py").write_text(LOOPS)
    command = [*FSDP_LAB, "grade", "s", "--json", "--time-limit", "30"]
    cgroups = set(_cgroups_of_ours())  # another run's, if any
    proc = subprocess.Popen(command, cwd=tmp_path, env={**os.environ, "TMPDIR": str(temp)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    seen: set[int] = set()
    deadline = time.monotonic() + 120  # a ceiling: the first sandbox is up within seconds
    while time.monotonic() < deadline:  # until a submission runs in its sandbox
        below = _descendants_of(proc.pid)
        seen |= {p.pid for p in below}
        if any("submission" in " ".join(p.cmdline()) for p in below if p.is_running()):
            break
        time.sleep(0.2)
    time.sleep(1.0)
    seen |= {p.pid for p in _descendants_of(proc.pid)}
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert json.loads(out)["error"].startswith(f"ended by {signal.Signals(sig).name}")
    time.sleep(0.5)
    assert [p for p in seen if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
            ] == []  # fmt: skip
    assert [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor")] == []
    assert set(_cgroups_of_ours()) - cgroups == set()


def test_a_gradebook_that_cannot_be_written_at_the_end_loses_no_grade(tmp_path, capfd,
                                                                      monkeypatch):  # fmt: skip
    """A hostile review: a disk filled (or a folder planted) after the up-front check cost the
    whole class's grades — exit 1, no table. The grades are printed first now."""
    from fsdp_lab import cli
    from fsdp_lab.course import gradebook

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gradebook, "write_csv", full)
    (tmp_path / "ann.py").write_text("x = 1\n")
    code = cli.main(["grade", str(tmp_path / "ann.py"), "--csv", str(tmp_path / "g.csv"),
                     "--json"])  # fmt: skip
    out, err = capfd.readouterr()
    payload = json.loads(out)
    assert code == 1 and payload["submissions"][0]["student"] == "ann"
    assert "could not be written" in payload["gradebook_error"] and "JSON" in err


RAISED = """
import resource
from fsdp_lab.course.grading import check_grader_environment
resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))
try:
    check_grader_environment()
    print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
except ValueError as exc:
    print(exc)
"""


def test_a_low_open_files_limit_is_raised_or_refused_before_grading():
    """A hostile review: under `ulimit -n 40` the grader's reference failed as "please report
    this line". The soft limit is raised to what the hard one allows (any process may); a hard
    limit too low for a class is wrong input, naming the fix."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    raised = subprocess.run([sys.executable, "-c", RAISED.format(soft=40, hard=hard)],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert int(raised.stdout) >= 256, raised.stderr
    refused = subprocess.run([sys.executable, "-c", RAISED.format(soft=40, hard=64)],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "ulimit -n 4096" in refused.stdout, refused.stderr


@pytest.mark.skipif(bwrap() is None, reason="bubblewrap cannot run here (CI installs it)")
def test_a_sandbox_that_cannot_run_python_stops_grading_as_the_graders_error(tmp_path):
    """A hostile review: graded with a Python the sandbox could not start (it needed a
    variable the sandbox clears), every file got "no result" and 0, and grading exited 0. A
    canary runs first now: the grader's error, one line, no row blames a student."""
    from fsdp_lab.course.grading import GraderError, check_sandbox_runs

    with pytest.raises(GraderError, match="the sandbox cannot run this Python"):
        check_sandbox_runs(binds=[])  # nothing of Python's bound: it cannot start
