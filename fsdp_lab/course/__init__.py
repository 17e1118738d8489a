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
__getattr__, __dir__ = lazy_names(
    __name__, {"EXERCISES": "fsdp_lab.course.catalog", "LABS": "fsdp_lab.course.catalog"}, globals()
)


def exercise(name: str) -> Any:
    """The `Exercise` called `name`; a ValueError naming the closest ones if there is none."""
    from fsdp_lab.course.catalog import exercise as find

    return find(name)


__all__ = [
    "EXERCISES",
    "LABS",
    "ClusterPool",
    "ExerciseFailed",
    "Verdict",
    "exercise",
    "grade",
    "check_all_reduce_mean",
    "check_gather_shards",
    "check_reduce_scatter_grad",
    "check_free_unsharded",
    "check_unit_to_prefetch",
    "check_cast_floats",
    "check_rerun_with_forward_rng",
    "check_sqrt_segment_starts",
    "check_split_ties",
    "check_group_tied_units",
    "check_param_shard",
    "check_retie",
    "check_stage_seeds",
    "check_hand_over",
    "check_hsdp_reduce_grad",
    "check_mesh_groups",
]


def grade(name: str, fn: Any, pool: ClusterPool | None = None) -> Verdict:
    """The verdict of `fn` on exercise `name` (nothing shown, nothing raised)."""
    return _grade(exercise(name), fn, pool)


# One check per exercise, in teaching order: the names the learner notebooks call. Each runs
# the learner's function on live ranks against the reference, shows the verdict and raises
# ExerciseFailed unless it passed; `pool` is a ClusterPool to reuse (else one is started and
# stopped for this check).


def check_all_reduce_mean(fn: Any, pool: ClusterPool | None = None) -> None:
    """Check your `all_reduce_mean` on live ranks; raise ExerciseFailed unless it passes."""
    _check(exercise("all_reduce_mean"), fn, pool)


def check_gather_shards(fn: Any, pool: ClusterPool | None = None) -> None:
    """Check your `gather_shards` on live ranks; raise ExerciseFailed unless it passes."""
    _check(exercise("gather_shards"), fn, pool)


def check_reduce_scatter_grad(fn: Any, pool: ClusterPool | None = None) -> None:
    """Check your `reduce_scatter_grad` on live ranks; raise ExerciseFailed unless it passes."""
    _check(exercise("reduce_scatter_grad"), fn, pool)


def check_free_unsharded(fn: Any, pool: ClusterPool | None = None) -> None:
    """Check your `free_unsharded` on live ranks; raise ExerciseFailed unless it passes."""
    _check(exercise("free_unsharded"), fn, pool)


def check_unit_to_prefetch(fn: Any, pool: ClusterPool | None = None) -> None:
    """Check your `unit_to_prefetch` on live ranks; raise ExerciseFailed unless it passes."""
    _check(exercise("unit_to_prefetch"), fn, pool)


def check_cast_floats(fn: Any, pool: ClusterPool | None = None) -> None:
    """Check your `cast_floats` on live ranks; raise ExerciseFailed unless it passes."""
    _check(exercise("cast_floats"), fn, pool)


def check_rerun_with_forward_rng(fn: Any, pool: ClusterPool | None = None) -> None:
    """Check your `rerun_with_forward_rng` on live ranks; raise ExerciseFailed unless it passes."""
    _check(exercise("rerun_with_forward_rng"), fn, pool)


def check_sqrt_segment_starts(fn: Any, pool: ClusterPool | None = None) -> None:
    """Check your `sqrt_segment_starts` on live ranks; raise ExerciseFailed unless it passes."""
    _check(exercise("sqrt_segment_starts"), fn, pool)


def check_split_ties(fn: Any, pool: ClusterPool | None = None) -> None:
    """Check your `split_ties` on live ranks; raise ExerciseFailed unless it passes."""
    _check(exercise("split_ties"), fn, pool)


def check_group_tied_units(fn: Any, pool: ClusterPool | None = None) -> None:
    """Check your `group_tied_units` on live ranks; raise ExerciseFailed unless it passes."""
    _check(exercise("group_tied_units"), fn, pool)


def check_param_shard(fn: Any, pool: ClusterPool | None = None) -> None:
    """Check your `param_shard` on live ranks; raise ExerciseFailed unless it passes."""
    _check(exercise("param_shard"), fn, pool)


def check_retie(fn: Any, pool: ClusterPool | None = None) -> None:
    """Check your `retie` on live ranks; raise ExerciseFailed unless it passes."""
    _check(exercise("retie"), fn, pool)


def check_stage_seeds(fn: Any, pool: ClusterPool | None = None) -> None:
    """Check your `stage_seeds` on live ranks; raise ExerciseFailed unless it passes."""
    _check(exercise("stage_seeds"), fn, pool)


def check_hand_over(fn: Any, pool: ClusterPool | None = None) -> None:
    """Check your `hand_over` on live ranks; raise ExerciseFailed unless it passes."""
    _check(exercise("hand_over"), fn, pool)


def check_hsdp_reduce_grad(fn: Any, pool: ClusterPool | None = None) -> None:
    """Check your `hsdp_reduce_grad` on live ranks; raise ExerciseFailed unless it passes."""
    _check(exercise("hsdp_reduce_grad"), fn, pool)


def check_mesh_groups(fn: Any, pool: ClusterPool | None = None) -> None:
    """Check your `mesh_groups` on live ranks; raise ExerciseFailed unless it passes."""
    _check(exercise("mesh_groups"), fn, pool)
