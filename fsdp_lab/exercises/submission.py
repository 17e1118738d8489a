"""One submitted file, graded in this process: read it, run the learner's code, check every
exercise it defines. `fsdp-lab grade` runs this module once per file, in its own process
(`python -m fsdp_lab.exercises.submission FILE`), so a submission that hangs, exits or crashes
the interpreter costs only itself; the JSON object it prints is that file's grades.

What counts as the learner's code: in a notebook, every code cell except the checks (nbgrader's
autograded test cells, or any cell calling `check_...`), with IPython syntax (`%magic`, `!cmd`)
turned into Python as Jupyter would; in a `.py` file, the whole file. It runs in a fresh
namespace whose module name is not importable, so the functions travel to the ranks by value,
as from a notebook.

Which exercises: those of every lab one of whose exercise functions the submission defines. A
function of that lab that is missing scores 0 with the verdict "missing".
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from fsdp_lab.exercises.catalog import LABS
from fsdp_lab.exercises.checker import grade
from fsdp_lab.exercises.pool import DEFAULT_TIME_LIMIT, ClusterPool
from fsdp_lab.exercises.verdict import Verdict

SUFFIXES = (".ipynb", ".py")


class BadSubmission(Exception):
    """The file cannot be graded at all (not a notebook or Python file, unparsable)."""


def code_cells(path: Path) -> list[str]:
    """The learner's code of `path`, as Python source blocks, in order."""
    if path.suffix not in SUFFIXES:
        raise BadSubmission(
            f"{path.name}: not a notebook (.ipynb) or Python file (.py) — nothing graded"
        )
    text = path.read_text(errors="replace")
    if path.suffix == ".py":
        return [text]
    import nbformat
    from IPython.core.inputtransformer2 import TransformerManager

    try:
        nb = nbformat.reads(text, as_version=4)
    except Exception as exc:  # nbformat raises several kinds for a broken file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BadSubmission(f"{path.name}: not a readable notebook ({first[:120]})") from None
    python = TransformerManager()
    blocks = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("grade") or "check_" in cell.source:
            continue  # the checks: the grader runs them itself
        blocks.append(python.transform_cell(cell.source))
    return blocks


def learner_namespace(blocks: list[str], path: Path) -> tuple[dict[str, Any], list[str]]:
    """Run the blocks; the names they defined, and one note per block that raised."""
    namespace: dict[str, Any] = {"__name__": "__submission__", "__file__": str(path)}
    notes = []
    for i, block in enumerate(blocks, 1):
        try:
            code = compile(block, f"{path.name} [cell {i}]", "exec")
            with contextlib.redirect_stdout(io.StringIO()):
                exec(code, namespace)  # the learner's own code: that is what grading runs
        except Exception as exc:
            line = traceback.format_exception_only(type(exc), exc)[-1].strip()
            notes.append(f"cell {i} raised {line}")
    return namespace, notes


def grade_file(path: Path, pool: ClusterPool, only: str | None = None) -> dict[str, Any]:
    """{"file", "verdicts": [Verdict.to_dict()], "notes": [...]} or {"file", "error"}."""
    try:
        blocks = code_cells(path)
    except BadSubmission as exc:
        return {"file": str(path), "error": str(exc)}
    namespace, notes = learner_namespace(blocks, path)
    verdicts: list[Verdict] = []
    labs = [lab for lab, group in LABS.items() if any(e.name in namespace for e in group)]
    if not labs:
        names = ", ".join(e.name for g in LABS.values() for e in g)
        return {
            "file": str(path),
            "error": f"{path.name}: defines none of the exercise functions ({names})",
            "notes": notes,
        }
    for lab in labs:
        for ex in LABS[lab]:
            if only is not None and ex.name != only:
                continue
            fn = namespace.get(ex.name)
            if fn is None:
                verdicts.append(
                    Verdict(ex.name, "missing", f"no function {ex.name} in the file", ex.points)
                )
                continue
            verdicts.append(grade(ex, fn, pool))
    return {"file": str(path), "verdicts": [v.to_dict() for v in verdicts], "notes": notes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="grade one submission; print one JSON object")
    parser.add_argument("path", type=Path)
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT)
    parser.add_argument("--only", default=None)
    args = parser.parse_args(argv)
    # Everything the learner's code, the ranks and C libraries print goes to stderr: fd 1 is
    # pointed there, and the one JSON object goes to a private copy of the real stdout.
    sys.stdout.flush()
    private = os.dup(1)
    os.dup2(2, 1)
    with contextlib.redirect_stdout(sys.stderr), ClusterPool(args.time_limit) as pool:
        result = grade_file(args.path, pool, args.only)
    os.write(private, (json.dumps(result) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
