"""The learner notebooks, written from the exercises: `notebooks/exercises/NN_<lab>.ipynb`.

One notebook per lab, numbered like the lab's own notebook. Each exercise is three cells:

- the statement, with hints that open on demand (HTML `<details>`: closed until clicked);
- the learner's cell: the stub, its body between nbgrader's solution marks
  (`### BEGIN SOLUTION` / `### END SOLUTION`) holding only `raise NotImplementedError()` —
  the reference solution lives in the package, never in a notebook a learner gets;
- the check cell, `course.check_<name>(<name>, pool)`: an nbgrader autograded test cell
  with the exercise's points (locked: a learner cannot edit the test). It reloads
  `fsdp_lab.course` first, so a learner's cell that replaced a check with a no-op does not
  grade itself (nbgrader runs the learner's code in the kernel the tests run in: see
  docs/teaching.md for what that cannot protect).

The cells carry nbgrader's metadata (schema 3), so `nbgrader generate_assignment` and
`autograde` use the notebooks as they are; without nbgrader they are ordinary notebooks, and
`fsdp-lab grade` reads the same metadata to tell the learner's cells from the checks.
`python -m fsdp_lab.course.authoring [--check]` writes them (or checks they are current).
"""

from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path
from typing import Any

import nbformat

from fsdp_lab.course.catalog import LABS
from fsdp_lab.exercise import Exercise
from fsdp_lab.labs.registry import LABS as LABS_BY_NAME

FOLDER = Path(__file__).resolve().parents[2] / "notebooks" / "exercises"
NUMBER = {lab: i for i, lab in enumerate(LABS)}  # 00_collectives ... 06_hsdp, as the labs
COMMON_IMPORTS = (
    "import importlib\n\n"
    "import torch\n"
    "import torch.distributed as dist\n"
    "from torch import nn\n"
    "\n"
    "from fsdp_lab import comm, course, rank, world_size"
)
SOLUTION_BODY = "    ### BEGIN SOLUTION\n    raise NotImplementedError()\n    ### END SOLUTION\n"


def notebook_name(lab: str) -> str:
    """The lab's notebooks' file name, in notebooks/ and in notebooks/exercises/ alike: its
    number and its topic's folder (``fsdp-lab shard`` -> ``01_sharding.ipynb``)."""
    topic = LABS_BY_NAME[lab].package.split(".")[1]  # "fsdp_lab.sharding.lab" -> "sharding"
    return f"{NUMBER[lab]:02d}_{topic}.ipynb"


def _meta(
    grade_id: str,
    *,
    solution: bool = False,
    grade: bool = False,
    points: int = 0,
    locked: bool = True,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "grade": grade,
        "grade_id": grade_id,
        "locked": locked,
        "schema_version": 3,
        "solution": solution,
        "task": False,
    }
    if grade:
        meta["points"] = points
    return {"nbgrader": meta}


def _hints(ex: Exercise) -> str:
    return "\n".join(
        f"<details><summary>Hint {i}</summary>\n\n{html.escape(h, quote=False)}\n\n</details>"
        for i, h in enumerate(ex.hints, 1)
    )


def exercise_cells(ex: Exercise, index: int) -> list[Any]:
    """Statement (with hints), the learner's cell, the check cell."""
    bugs = ", ".join(b.title for b in ex.bugs)
    statement = (
        f"## Exercise {index}: {ex.title}\n\n{ex.statement}\n\n"
        f"*{ex.points} points · about {ex.minutes} minutes.*"
        + (f" The check catches, among others: {bugs}." if bugs else "")
        + "\n\n"
        + _hints(ex)
    )
    code = (ex.setup.strip() + "\n\n\n" if ex.setup.strip() else "") + ex.stub.rstrip() + "\n"
    code += SOLUTION_BODY
    check = (
        "course = importlib.reload(course)  # the checks as installed\n"
        f"course.check_{ex.name}({ex.name}, pool)"
    )
    return [
        nbformat.v4.new_markdown_cell(statement, metadata=_meta(f"{ex.name}_statement")),
        nbformat.v4.new_code_cell(
            code.rstrip(), metadata=_meta(ex.name, solution=True, locked=False)
        ),
        nbformat.v4.new_code_cell(
            check, metadata=_meta(f"check_{ex.name}", grade=True, points=ex.points)
        ),
    ]


def lab_notebook(lab: str) -> Any:
    from fsdp_lab.labs.registry import LABS as LAB_INFO

    group = LABS[lab]
    total = sum(ex.points for ex in group)
    intro = (
        f"# Exercises: {LAB_INFO[lab].title}\n\n"
        f"Write the few lines of each step below; its check runs your function **inside the "
        f"real mechanism on live ranks** (separate processes, gloo), against the reference, on "
        f"several cases, and says which case failed, what it expected and what it got, with a "
        f"hint. Write your code in place of `raise NotImplementedError()` (between the two "
        f"SOLUTION marks), then run the check cell below it. A function that raises, hangs or returns the wrong shape is "
        f"reported as such, and the ranks survive for your next attempt.\n\n"
        f"{len(group)} exercises, {total} points. The lab notebook "
        f"`notebooks/{notebook_name(lab)}` shows the mechanism these steps belong to."
    )
    setup = (
        COMMON_IMPORTS + "\n\n"
        "# Live ranks for the checks, started on the first check and kept between checks.\n"
        "pool = course.ClusterPool()"
    )
    cells = [
        nbformat.v4.new_markdown_cell(intro, metadata=_meta("intro")),
        nbformat.v4.new_code_cell(setup, metadata=_meta("setup")),
    ]
    for i, ex in enumerate(group, 1):
        cells += exercise_cells(ex, i)
    cells.append(
        nbformat.v4.new_code_cell(
            "pool.close()  # stops the ranks (closing the notebook does too)",
            metadata=_meta("teardown"),
        )
    )
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "display_name": "Python 3",
        "language": "python",
        "name": "python3",
    }
    nb.metadata["language_info"] = {"name": "python"}
    for n, cell in enumerate(nb.cells):  # stable ids: regenerating changes nothing
        cell["id"] = f"{lab.replace('-', '')}-{n:02d}"
    return nb


def write_all(check: bool = False) -> list[str]:
    """Write every lab's notebook (labs with exercises); with `check`, only list those that
    differ from what would be written."""
    stale = []
    FOLDER.mkdir(parents=True, exist_ok=True)
    for lab, group in LABS.items():
        if not group:
            continue
        path = FOLDER / notebook_name(lab)
        text = nbformat.writes(lab_notebook(lab)) + "\n"
        if path.exists() and path.read_text() == text:
            continue
        stale.append(str(path))
        if not check:
            path.write_text(text)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a notebook is stale")
    args = parser.parse_args(argv)
    stale = write_all(check=args.check)
    for path in stale:
        print(("stale: " if args.check else "wrote ") + path)
    if args.check and stale:
        print("fix: python -m fsdp_lab.course.authoring", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
