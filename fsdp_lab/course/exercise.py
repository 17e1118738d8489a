"""What an exercise is: one key step of a mechanism, run inside the real mechanism on live ranks.

A learner writes one small function (the reduce-scatter of a unit's gradient, the recompute of a
checkpointed segment, ...). The exercise knows how to put that function where the real mechanism
calls it (`trial`, which runs on every rank), how to tell right from wrong from what the ranks
measured (`judge`, which runs where the grade is made), the cases worth trying (world sizes that
divide and that do not, tied and untied models, uneven stages) and the classic bugs a learner
makes, each written out as a wrong version of the solution (`Bug`). The same bugs, switched on in
the reference mechanism, are the bug gallery (`fsdp_lab.course.gallery`).

    check_<name>(fn) ──▶ signature ──▶ for each case:
        got      = cluster.run(trial, fn, case)         the learner's function, on its ranks
        expected = cluster.run(trial, solution, case)   the reference, on ranks it never touched
        judge(got, expected, case) ─▶ Mismatch or None

The learner's run and the reference's run are separate calls, so `fsdp-lab grade` can make them
in separate processes: the learner's in a sandbox, the reference's in ranks no learner code ever
ran in (a learner's function that patches `dist.get_world_size` on its rank cannot change the
reference). What a trial returns is plain data (numbers, strings, lists, dicts): it crosses from
the learner's processes to the judge as JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Case:
    """One situation the learner's function must handle.

    Args:
        label: what a learner reads in the verdict ("3 ranks, 10 elements: not divisible").
        world_size: ranks the case runs on.
        params: plain values the trial reads (sizes, seeds, which model).
    """

    label: str
    world_size: int
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Mismatch:
    """Why a case failed, in terms a learner can act on.

    Args:
        summary: one line: what is wrong, measured ("the gradient is 2x the reference on rank 0").
        rows: (what, expected, got) rows of a small table.
        hint: one sentence pointing at the fix.
        series: optional curves to draw, expected beside got: {"title", "xlabel", "ylabel",
            "lines": {name: [values]}} (a memory trace that never drops, a drifting loss).
    """

    summary: str
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    hint: str = ""
    series: dict[str, Any] | None = None


@dataclass(frozen=True)
class Bug:
    """A classic mistake, written out as a wrong version of the reference solution.

    Args:
        slug: short name for the CLI and tests ("no-divide").
        title: what the bug is, in the words a course uses ("missing ÷ world size").
        wrong: the buggy function, with the exercise's signature.
        symptom: what the lab measures when the bug is on (one sentence, no figures: the
            figures come from the run).
    """

    slug: str
    title: str
    wrong: Callable[..., Any]
    symptom: str


@dataclass(frozen=True)
class Exercise:
    """One graded step of one lab.

    Args:
        name: the function the learner writes, and the checker's suffix (`check_<name>`).
        lab: the lab it belongs to ("collectives", "shard", ...).
        title: one line.
        statement: what to write, Markdown (a few sentences, the signature's meaning).
        stub: the learner's starting code: the signature, a docstring, no solution.
        hang_hint: the hint of a "hung" verdict, when this step has a classic way to hang
            (a stage index sent where a rank was meant); else the general one.
        setup: import lines the learner's cell needs beyond the notebook's common ones
            (torch, dist, nn, comm, rank, world_size), put above the stub.
        hints: opened one by one on demand, most general first.
        solution: the reference implementation (never shown in a learner notebook).
        trial: runs on every rank: ``trial(fn, case) -> plain data`` puts `fn` into the real
            mechanism and returns what was measured (the same trial measures the reference,
            with `solution` as `fn`).
        judge: runs where the grade is made: ``judge(got, expected, case) -> Mismatch | None``
            from the learner's and the reference's per-rank outcomes, in rank order. Whatever
            the judge needs besides the learner's values (a store-all baseline, the unsharded
            model's forward) it reads from `expected`: only the reference's run is trusted.
        cases: tried in order; the first that fails is the verdict.
        bugs: the classic mistakes this exercise catches.
        points: for nbgrader and `fsdp-lab grade`.
        minutes: how long the exercise takes a learner, roughly (the instructor guide).
    """

    name: str
    lab: str
    title: str
    statement: str
    stub: str
    hints: tuple[str, ...]
    solution: Callable[..., Any]
    trial: Callable[[Callable[..., Any], Case], Any]
    judge: Callable[[list[Any], list[Any], Case], Mismatch | None]
    cases: tuple[Case, ...]
    bugs: tuple[Bug, ...] = ()
    points: int = 2
    minutes: int = 10
    setup: str = ""
    hang_hint: str = ""

    def bug(self, slug: str) -> Bug:
        """The bug named `slug`, or a ValueError listing the ones there are."""
        for b in self.bugs:
            if b.slug == slug:
                return b
        known = ", ".join(b.slug for b in self.bugs) or "none"
        raise ValueError(f"bug {slug!r} of exercise {self.name!r}: expected one of {known}")
