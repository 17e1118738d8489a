"""Course mode: graded exercises on live ranks, an autograder that explains, a bug gallery.

    from fsdp_lab import course
    pool = course.ClusterPool()                      # live ranks, kept between checks
    course.check_all_reduce_mean(all_reduce_mean, pool)   # shows a verdict; raises if wrong

Each `check_<name>(fn, pool=None)` runs the learner's `fn` inside the real mechanism on live
ranks, against the reference solution, on several cases, and shows a verdict (which case,
expected vs got, one hint; the traceback of a rank that raised or hung). It raises
`ExerciseFailed` (an AssertionError, so nbgrader scores the cell 0) when the verdict is not
"passed". `grade(name, fn, pool)` returns the `Verdict` without showing or raising.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

if f"{__name__}.checker" in sys.modules:
    # A reload (the autograded cell of a learner notebook does `importlib.reload(course)`):
    # the checker as installed, whatever a learner's cell replaced in it.
    importlib.reload(sys.modules[f"{__name__}.checker"])

from fsdp_lab.course.checker import check as _check  # noqa: E402
from fsdp_lab.course.checker import grade as _grade  # noqa: E402
from fsdp_lab.course.pool import ClusterPool  # noqa: E402
from fsdp_lab.course.verdict import ExerciseFailed, Verdict  # noqa: E402
from fsdp_lab.lazy import lazy_names  # noqa: E402

# The catalog imports every topic's exercises, which build on this package's parts (`exercise`,
# `judging`, `on_rank`): it is read on first use, so those imports never meet halfway.
_lazy_getattr, _lazy_dir = lazy_names(
    __name__, {"EXERCISES": "fsdp_lab.course.catalog", "LABS": "fsdp_lab.course.catalog"}, globals()
)


def exercise(name: str) -> Any:
    """The `Exercise` called `name`; a ValueError naming the closest ones if there is none."""
    from fsdp_lab.course.catalog import exercise as find

    return find(name)


def grade(name: str, fn: Any, pool: ClusterPool | None = None) -> Verdict:
    """The verdict of `fn` on exercise `name` (nothing shown, nothing raised)."""
    return _grade(exercise(name), fn, pool)


# One check per exercise of the catalog, `check_<name>(fn, pool=None)`: the names the learner
# notebooks call, made on first use from the catalog (each exercise is registered once, in its
# topic's `exercises/`), and listed by `dir()` so that a notebook completes them. Each runs the
# learner's function on live ranks against the reference, shows the verdict and raises
# ExerciseFailed unless it passed; `pool` is a ClusterPool to reuse (else one is started and
# stopped for this check).


def _check_of(name: str) -> Callable[..., None]:
    def check(fn: Any, pool: ClusterPool | None = None) -> None:
        _check(exercise(name), fn, pool)

    check.__name__ = check.__qualname__ = f"check_{name}"
    check.__doc__ = f"Check your `{name}` on live ranks; raise ExerciseFailed unless it passes."
    return check


def _checks() -> list[str]:
    from fsdp_lab.course.catalog import EXERCISES

    return [f"check_{e.name}" for e in EXERCISES]


def __getattr__(name: str) -> Any:
    if name.startswith("check_"):
        try:  # a typo in a notebook: the catalog names the exercise it meant
            exercise(name.removeprefix("check_"))
        except ValueError as exc:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}: {exc}") from None
        globals()[name] = _check_of(name.removeprefix("check_"))
        return globals()[name]
    return _lazy_getattr(name)


def __dir__() -> list[str]:
    return sorted({*_lazy_dir(), *_checks()})


__all__ = ["EXERCISES", "LABS", "ClusterPool", "ExerciseFailed", "Verdict", "exercise", "grade"]
