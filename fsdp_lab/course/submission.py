"""One submitted file, run where it can harm nothing: the learner's side of grading.

`fsdp-lab grade` runs this module once per file, inside the sandbox
(`fsdp_lab.course.sandbox`), as ``python -m fsdp_lab.course.submission FILE`` with the ranks'
fork server started first (`grading.RUN_SUBMISSION`: it imports torch and every exercise while
the learner's code runs). It reads the
file, runs the learner's code, and runs each exercise's trial with the learner's function on
live ranks — nothing else. It never sees a reference outcome and never makes a verdict: its
reply (JSON lines on file descriptor 3) says only what the learner's code did, and the grader,
in a process the learner's code never touched, judges that against the reference.

The reply, one JSON object per line:
    {"notes": [...], "defined": [names]}               after the learner's code ran
    {"exercise": name, "runs": [...]}                  an exercise's runs (`checker.run_case`)
    {"exercise": name, "wrong_signature": "..."}       ... or why it could not be called
    {"error": "..."}                                   the file cannot be graded at all

What counts as the learner's code: in a notebook, every code cell except nbgrader's locked
test cells, with the statements that call a `check_...` function removed (the grader runs the
checks itself), and IPython syntax (`%magic`, `!cmd`) turned into Python as Jupyter would; in
a `.py` file, the whole file. It runs in a fresh namespace whose module name is not importable,
so the functions travel to the ranks by value, as from a notebook. Each cell may run for the
time limit of one case.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import linecache
import os
import signal
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SUFFIXES = (".ipynb", ".py")
REPLY_FD = 3


class BadSubmission(Exception):
    """The file cannot be graded at all (not a notebook or Python file, unparsable)."""


def code_cells(path: Path, name: str | None = None) -> list[str]:
    """The learner's code of `path`, as Python source blocks, in order (`name`: the file's name
    in messages, when it was copied under another)."""
    name = name or path.name
    if path.suffix not in SUFFIXES:
        raise BadSubmission(
            f"{name}: not a notebook (.ipynb) or Python file (.py) — nothing graded"
        )
    text = path.read_text(errors="replace")
    if path.suffix == ".py":
        return [text]
    try:
        nb = json.loads(text)
        cells = nb["cells"]
        if not isinstance(cells, list):
            raise TypeError("'cells' is not a list")
    except (ValueError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BadSubmission(f"{name}: not a readable notebook ({first[:120]})") from None
    from IPython.core.inputtransformer2 import TransformerManager

    python = TransformerManager()
    blocks = []
    for cell in cells:
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        meta = cell.get("metadata")
        nbgrader = meta.get("nbgrader") if isinstance(meta, dict) else None
        if isinstance(nbgrader, dict) and nbgrader.get("grade") and not nbgrader.get("solution"):
            continue  # nbgrader's locked test cell: the grader runs the checks itself
        source = cell.get("source", "")
        if isinstance(source, list):  # a line that is not text is left out, the rest is read
            source = "".join(line for line in source if isinstance(line, str))
        if not isinstance(source, str):
            continue
        with contextlib.suppress(Exception):  # what IPython cannot read stays as it is
            source = python.transform_cell(source)
        blocks.append(without_checks(source))
    return blocks


def without_checks(source: str) -> str:
    """`source` without its statements that call a `check_...` function (a learner's own
    `course.check_x(x, pool)`); a comment or a name that merely mentions one stays."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source  # the learner sees the SyntaxError as a note of that cell

    def calls_a_check(node: ast.stmt) -> bool:
        for call in ast.walk(node):
            if isinstance(call, ast.Call):
                f = call.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name.startswith("check_"):
                    return True
        return False

    lines = source.splitlines(keepends=True)
    for node in reversed(tree.body):
        if isinstance(node, ast.Expr | ast.Assign) and calls_a_check(node):
            end = node.end_lineno or node.lineno
            lines[node.lineno - 1 : end] = ["pass\n"] * (end - node.lineno + 1)
    return "".join(lines)


class CellTimeout(BaseException):
    """A cell of the learner's code ran past its time (a BaseException: `except Exception` in
    the learner's code does not swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def stop(signum: int, frame: Any) -> None:
        raise CellTimeout()

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def learner_namespace(
    blocks: list[str], path: Path, seconds: float, name: str | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Run the blocks, each for at most `seconds`; the names they defined, and one note per
    block that raised or ran too long. What they print goes to stderr."""
    namespace: dict[str, Any] = {"__name__": "__submission__", "__file__": str(path)}
    notes = []
    for i, block in enumerate(blocks, 1):
        try:
            where = f"{name or path.name} [cell {i}]"
            # Its lines where a traceback can find them: a verdict shows the learner's own line.
            linecache.cache[where] = (len(block), None, block.splitlines(True), where)
            code = compile(block, where, "exec")
            with contextlib.redirect_stdout(sys.stderr), time_limit(seconds):
                exec(code, namespace)  # the learner's own code: that is what grading runs
        except CellTimeout:
            notes.append(f"cell {i} ran past {seconds:g} s and was stopped")
        except Exception as exc:
            line = traceback.format_exception_only(type(exc), exc)[-1].strip()
            notes.append(f"cell {i} raised {line[:300]}")
    return namespace, notes


def run_file(path: Path, time_limit_s: float, only: str | None, say: Any, name: str) -> None:
    """Run the learner's code of `path` and the trials of every exercise of the labs it
    defines a function of; `say(obj)` sends each reply line; `name` is the file's in messages."""
    from fsdp_lab.course.catalog import EXERCISES, LABS

    try:
        blocks = code_cells(path, name)
    except BadSubmission as exc:
        say({"error": str(exc)})
        return
    namespace, notes = learner_namespace(blocks, path, time_limit_s, name)
    defined = [e.name for e in EXERCISES if e.name in namespace]
    say({"notes": notes, "defined": defined})
    from fsdp_lab.course.checker import learner_runs, signature_problem
    from fsdp_lab.course.pool import ClusterPool

    wanted = [
        e
        for group in LABS.values()
        if any(e.name in defined for e in group)
        for e in group
        if e.name in defined and (only is None or e.name == only)
    ]
    if not wanted:
        return
    with ClusterPool(time_limit_s) as pool:
        for ex in wanted:
            fn = namespace[ex.name]
            problem = signature_problem(ex, fn)
            if problem is not None:
                say({"exercise": ex.name, "wrong_signature": problem})
                continue
            say({"exercise": ex.name, "runs": list(learner_runs(ex, fn, pool))})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run one submission's trials; reply on fd 3")
    parser.add_argument("path", type=Path)
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--only", default=None)
    parser.add_argument("--name", default=None, help="the file's name in messages")
    args = parser.parse_args(argv)
    reply = os.fdopen(REPLY_FD, "w")

    def say(obj: dict[str, Any]) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    run_file(args.path, args.time_limit, args.only, say, args.name or args.path.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
