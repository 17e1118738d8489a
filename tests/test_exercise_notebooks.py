"""The learner notebooks in notebooks/exercises/: current with the exercises, ready for nbgrader,
and — with the reference solutions put in the learners' cells — every check passes when the
notebook runs top to bottom in a real kernel."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from fsdp_lab.course import EXERCISES, LABS
from fsdp_lab.course.authoring import FOLDER, notebook_name, write_all

NOTEBOOKS = sorted(FOLDER.glob("*.ipynb"))


def test_every_lab_with_exercises_has_its_notebook_and_it_is_current():
    expected = sorted(notebook_name(lab) for lab, group in LABS.items() if group)
    assert [p.name for p in NOTEBOOKS] == expected
    assert write_all(check=True) == [], "fix: python -m fsdp_lab.course.authoring"


def _nbgrader(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_cells_carry_nbgrader_metadata_and_no_solution(path):
    nb = nbformat.read(path, as_version=4)
    solutions = [c for c in nb.cells if _nbgrader(c).get("solution")]
    tests = [c for c in nb.cells if _nbgrader(c).get("grade")]
    assert len(solutions) == len(tests) > 0
    ids = [_nbgrader(c)["grade_id"] for c in nb.cells]
    assert len(ids) == len(set(ids)) == len(nb.cells)  # nbgrader refuses duplicates
    for cell in solutions:  # the learner's cell holds the stub only
        body = cell.source.split("### BEGIN SOLUTION", 1)[1].split("### END SOLUTION", 1)[0]
        assert body.strip() == "raise NotImplementedError()"
    for cell in tests:
        assert _nbgrader(cell)["points"] > 0 and _nbgrader(cell)["locked"]
        # the checks as installed first (a learner's cell may have replaced them), then the check
        first, check = cell.source.splitlines()
        assert first.startswith("course = importlib.reload(course)")
        assert check.startswith("course.check_")


def with_solutions(nb, wrong: dict[str, str] | None = None):
    """The notebook with each learner cell replaced by the package's reference solution (or,
    for names in `wrong`, by that bug's function), as a test substitutes a learner."""
    wrong = wrong or {}
    for cell in nb.cells:
        meta = _nbgrader(cell)
        if meta.get("solution"):
            name = meta["grade_id"]
            pick = f'.bug("{wrong[name]}").wrong' if name in wrong else ".solution"
            cell.source = (
                "from fsdp_lab.course import exercise as _exercise\n"
                f'{name} = _exercise("{name}"){pick}'
            )
    return nb


def _execute(path: Path, folder: Path) -> tuple[object, float]:
    nb = with_solutions(nbformat.read(path, as_version=4))
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
    )
    start = time.perf_counter()
    try:
        client.execute()  # a failing check raises ExerciseFailed: CellExecutionError here
    except Exception as exc:  # reported by that notebook's test
        return exc, time.perf_counter() - start
    return nb, time.perf_counter() - start


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Every learner notebook run top to bottom with the reference solutions, one at a time (as
    `tests/test_notebooks.py` runs the labs' notebooks)."""
    folder = tmp_path_factory.mktemp("exercise_notebooks")
    return {p.name: _execute(p, folder) for p in NOTEBOOKS}


# Seven whole notebooks (70 s here): each check's reference is tested case by case in the
# exercises' own tests; the whole runs are end-to-end, made by CI after the suite (`pytest -m e2e`).
@pytest.mark.e2e
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_with_the_reference_solutions_every_check_passes(path, executed, record_property):
    nb, seconds = executed[path.name]
    if isinstance(nb, Exception):
        raise nb
    record_property("notebook_seconds", (f"exercises/{path.name}", seconds))
    shown = [
        o["data"]["text/markdown"]
        for c in nb.cells
        if _nbgrader(c).get("grade")
        for o in c.outputs
        if "text/markdown" in o.get("data", {})
    ]
    names = [_nbgrader(c)["grade_id"] for c in nb.cells if _nbgrader(c).get("grade")]
    assert len(shown) == len(names)
    for name, text in zip(names, shown, strict=True):
        assert text.startswith(f"**✓ {name.removeprefix('check_')}: passed"), text


def test_exercise_names_are_unique_python_names():
    names = [e.name for e in EXERCISES]
    assert len(names) == len(set(names)) and all(n.isidentifier() for n in names)
