"""Course mode: graded exercises on live ranks, an autograder that explains, a bug gallery.

    from fsdp_lab import exercises
    pool = exercises.ClusterPool()                      # live ranks, kept between checks
    exercises.check_all_reduce_mean(all_reduce_mean, pool)   # shows a verdict; raises if wrong

Each `check_<name>(fn, pool=None)` runs the learner's `fn` inside the real mechanism on live
ranks, against the reference solution, on several cases, and shows a verdict (which case,
expected vs got, one hint; the traceback of a rank that raised or hung). It raises
`ExerciseFailed` (an AssertionError, so nbgrader scores the cell 0) when the verdict is not
"passed". `grade(name, fn, pool)` returns the `Verdict` without showing or raising.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

if f"{__name__}.checker" in sys.modules:
    # A reload (the autograded cell of a learner notebook does `importlib.reload(exercises)`):
    # the checker as installed, whatever a learner's cell replaced in it.
    importlib.reload(sys.modules[f"{__name__}.checker"])

from fsdp_lab.exercises.catalog import EXERCISES, LABS, exercise  # noqa: E402
from fsdp_lab.exercises.checker import check as _check  # noqa: E402
from fsdp_lab.exercises.checker import grade as _grade  # noqa: E402
from fsdp_lab.exercises.pool import ClusterPool  # noqa: E402
from fsdp_lab.exercises.verdict import ExerciseFailed, Verdict  # noqa: E402

__all__ = [
    "EXERCISES",
    "LABS",
    "ClusterPool",
    "ExerciseFailed",
    "Verdict",
    "exercise",
    "grade",
]


def grade(name: str, fn: Any, pool: ClusterPool | None = None) -> Verdict:
    """The verdict of `fn` on exercise `name` (nothing shown, nothing raised)."""
    return _grade(exercise(name), fn, pool)


def _checker(name: str) -> Any:
    def check(fn: Any, pool: ClusterPool | None = None) -> None:
        _check(exercise(name), fn, pool)

    check.__name__ = check.__qualname__ = f"check_{name}"
    check.__doc__ = (
        f"Check your `{name}` on live ranks against the reference; show the verdict; raise "
        "ExerciseFailed if it is not passed. `pool`: a ClusterPool to reuse (else one is started "
        "and stopped for this check)."
    )
    return check


for _ex in EXERCISES:  # check_<name> for every exercise: the names the notebooks call
    globals()[f"check_{_ex.name}"] = _checker(_ex.name)
    __all__.append(f"check_{_ex.name}")
del _ex
