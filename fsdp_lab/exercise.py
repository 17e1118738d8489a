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

Below the exercise: what its judge uses (closeness, the ratio that names a bug, the curves a
verdict draws) and what runs on each rank during a check (the learner's function under a
watch). Every topic's `exercises/` builds on this module; the course engine (`fsdp_lab.course`)
runs them — so the engine uses the topics, and no topic uses the engine.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


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
        replayed: the learner's function maps plain data to plain data (no tensors, no side
            effects), so `fsdp-lab grade` keeps only what it answered on each rank and replays
            those answers inside the mechanism on the grader's own ranks (`Replay`): every figure
            the judge reads is then measured where no learner code ran.
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
    replayed: bool = False

    def bug(self, slug: str) -> Bug:
        """The bug named `slug`, or a ValueError listing the ones there are."""
        for b in self.bugs:
            if b.slug == slug:
                return b
        known = ", ".join(b.slug for b in self.bugs) or "none"
        raise ValueError(f"bug {slug!r} of exercise {self.name!r}: expected one of {known}")


RTOL, ATOL = 1e-5, 1e-7


class Impossible(ValueError):
    """A figure no run of the mechanism can measure (fewer bytes than a correct run must move or
    hold, an unknown label): only an altered reply has it, so the verdict is "invalid reply"."""


def at_least(got: float, floor: float, what: str) -> None:
    """Raise Impossible unless `got` >= `floor`, the least any correct run measures of `what`
    (the reference's figure, where the reference does the least the step allows)."""
    if not isinstance(got, int | float) or isinstance(got, bool) or not got >= floor:
        raise Impossible(f"{what}: {got!r}, below the {floor:g} any correct run measures")


def close(got: Sequence[float] | torch.Tensor, expected: Sequence[float] | torch.Tensor) -> bool:
    """Same length and equal to within float reordering."""
    g, e = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return g.shape == e.shape and bool(torch.allclose(g, e, rtol=RTOL, atol=ATOL))


def ratio(got: Sequence[float], expected: Sequence[float]) -> float | None:
    """The factor `got` is of `expected` (least squares), or None if `expected` is all zero."""
    g, e = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    if g.shape != e.shape or float(e @ e) == 0.0:
        return None
    return float((g @ e) / (e @ e))


def first_values(values: Sequence[float], n: int = 3) -> str:
    """A verdict's table cell: the first `n` values, 4 significant digits ("none" for none: a
    run that produced no values, not a blank cell)."""
    return ", ".join(f"{v:.4g}" for v in values[:n]) or "none"


def multiple(got: Sequence[float], expected: Sequence[float]) -> str:
    """ " (2× the reference's)" when `got` is exactly a multiple of `expected` (to float
    reordering), else "": a factor only where it explains every value."""
    k = ratio(got, expected)
    if k is None or abs(k - 1) < 1e-6 or not close(got, [k * v for v in expected]):
        return ""
    return f" ({k:.3g}× the reference's)"


def ratio_hint(
    got: Sequence[float], expected: Sequence[float], hints: dict[float, str], default: str = ""
) -> str:
    """The hint of the factor `got` is of `expected`, when it is one of `hints`' keys and
    `got` is that multiple exactly (not merely correlated); else `default`."""
    k = ratio(got, expected)
    if k is not None:
        for factor, hint in hints.items():
            scaled = [factor * v for v in expected]
            if abs(k - factor) <= 1e-4 * max(1.0, abs(factor)) and close(got, scaled):
                return hint
    return (
        default
        or "Compare your function with the statement line by line: the table above "
        "shows the first values that differ."
    )


def series_of(
    title: str, xlabel: str, ylabel: str, lines: dict[str, list[float]], in_bytes: bool = False
) -> dict[str, Any]:
    """Curves for `Mismatch.series`: the reference first."""
    return {"title": title, "xlabel": xlabel, "ylabel": ylabel, "lines": lines, "bytes": in_bytes}


# -- the one judge of "trained like the reference" ----------------------------------------------
# An exercise whose step sits inside data-parallel training (an average, a reduce-scatter, an
# HSDP reduce) has every rank's trial return {"weights", "first_grad", "losses"}: its parameters
# after the steps, its gradient of step 1 as the learner's function left it, its loss per step.


def replicas_apart(
    got: list[Any], expected: list[Any], replicas: Sequence[Sequence[int]], steps: int, hint: str
) -> Mismatch | None:
    """The first set of ranks meant to hold the same parameters (`replicas`) that does not."""
    for ranks in replicas:
        first = ranks[0]
        for r in ranks[1:]:
            if not close(got[r]["weights"], got[first]["weights"]):
                return Mismatch(
                    f"after {steps} steps ranks {first} and {r}, replicas of each other, hold "
                    "different parameters: the replicas drifted apart.",
                    rows=[
                        (
                            f"rank {q}'s parameters after {steps} steps, first values",
                            first_values(expected[q]["weights"]),
                            first_values(got[q]["weights"]),
                        )
                        for q in (first, r)
                    ],
                    hint=hint,
                )
    return None


def trained_unlike(
    got: list[Any],
    expected: list[Any],
    steps: int,
    hint_for: Callable[[int], str],
    what: str = "gradient",
) -> Mismatch | None:
    """The first rank whose step-1 gradient differs from the reference's: its first values (as
    an exact multiple of the reference's when it is one), the loss after `steps`, the two loss
    curves drifting apart, and `hint_for(rank)`. Ranks whose trial returned None sat out."""
    for r, (mine, exp) in enumerate(zip(got, expected, strict=True)):
        if exp is None or close(mine["first_grad"], exp["first_grad"]):
            continue
        return Mismatch(
            f"rank {r}'s {what} in step 1 differs from the reference"
            f"{multiple(mine['first_grad'], exp['first_grad'])}, and training drifts from it "
            f"over {steps} steps.",
            rows=[
                (
                    f"{what} of step 1, first values",
                    first_values(exp["first_grad"]),
                    first_values(mine["first_grad"]),
                ),
                (
                    f"loss after {steps} steps",
                    f"{exp['losses'][-1]:.6g}",
                    f"{mine['losses'][-1]:.6g}",
                ),
            ],  # fmt: skip
            hint=hint_for(r),
            series=loss_curves(f"loss per step, rank {r}", mine, exp),
        )
    return None


def loss_curves(title: str, got: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    """`Mismatch.series` of a run that trained: its loss per step beside the reference's."""
    lines = {"reference": expected["losses"], "yours": got["losses"]}
    return series_of(title, "step", "loss", lines)


HINT_MARK = " | hint: "  # WrongOutput's message, then the hint: one line, as a traceback ends


class WrongOutput(Exception):
    """The learner's function returned something of the wrong kind (type, shape, dtype)."""


def expect_tensor(got: Any, like: torch.Tensor, what: str, hint: str = "") -> torch.Tensor:
    """`got` if it is a tensor shaped and typed like `like`; else a WrongOutput saying so.

    Args:
        got: what the learner's function returned.
        like: the reference's value for the same input.
        what: what the value is, for the message ("this rank's gradient shard").
        hint: one sentence for the verdict when the value is wrong (else a general one).
    """
    try:
        return _expect_tensor(got, like, what)
    except WrongOutput as exc:
        if not hint:
            raise
        raise WrongOutput(f"{exc}{HINT_MARK}{hint}") from None


def _expect_tensor(got: Any, like: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(got, torch.Tensor):
        raise WrongOutput(
            f"{what}: expected a torch.Tensor of shape {tuple(like.shape)}, got "
            f"{type(got).__name__} ({got!r:.60})"
        )
    if tuple(got.shape) != tuple(like.shape):
        raise WrongOutput(f"{what}: expected shape {tuple(like.shape)}, got {tuple(got.shape)}")
    if got.dtype != like.dtype:
        raise WrongOutput(f"{what}: expected dtype {like.dtype}, got {got.dtype}")
    return got


def plain(value: Any) -> Any:
    """`value` as JSON data: tensors as (nested) lists, tuples as lists; a TypeError for what
    has no JSON form (a trial must return measurements, not objects)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"a trial's dict keys must be strings, got {list(value)[:5]}")
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"a trial returned {type(value).__name__}, which has no JSON form")


def attempt(
    trial: Callable[..., Any],
    fn: Callable[..., Any],
    case: Case,
    stack_file: str,
    dump_after: float,
    record: bool = False,
) -> str:
    """Run one trial on this rank and return, as JSON, what it measured (`outcome`) and, with
    `record`, every call of `fn` as [arguments, answer] (`answers`); if it is still running
    after `dump_after` seconds, write every thread's stack to `stack_file` (the driver reads it
    if the call then times out)."""
    from fsdp_lab.cluster import rank, rank_threads

    answers: list[list[Any]] = []

    def recorded(*args: Any) -> Any:
        answer = fn(*args)
        answers.append([plain(list(args)), recorded_answer(answer)])
        return answer

    # rank_threads: the cores shared by the ranks. N ranks x torch's default thread count
    # oversubscribe a laptop's cores and made checks several times slower. Every run (the
    # learner's, the reference's, in whatever process) uses the same threads, so values compare.
    # A learner's earlier function on these ranks may have changed torch's global modes: every
    # trial starts from torch's defaults (a correct function failed after one that had not).
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    release_groups()
    with open(stack_file.format(rank=rank()), "w") as out, rank_threads():
        faulthandler.dump_traceback_later(dump_after, file=out)
        try:
            outcome = trial(recorded if record else fn, case)
        finally:
            faulthandler.cancel_dump_traceback_later()
    return json.dumps({"outcome": plain(outcome), "answers": answers if record else None})


def release_groups() -> None:
    """Destroy every process group but the world's: those earlier trials on these ranks made
    (a trial's subgroups, a DeviceMesh's). Ranks that serve a whole class (the grader's
    reference ranks replay every learner's mesh) kept each group's sockets — about ten per
    layout on gloo — until the open files ran out and a later, correct answer failed inside
    gloo. Done as the next trial starts, when every rank has left the last one: at a trial's
    own end, a rank done early would pull a group from under a peer still waiting in it, and a
    hang would show as an error."""
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    left = [g for g in list(c10d._world.pg_map) if g is not c10d.GroupMember.WORLD]
    for group in left:
        with contextlib.suppress(Exception):
            dist.destroy_process_group(group)
    if left:  # a group's sockets close with its last reference, often held in a cycle
        gc.collect()


NOT_PLAIN, TENSOR = "not plain data", "tensor"


def recorded_answer(answer: Any) -> Any:
    """An answer as JSON data that `Replay` turns back into it: a tensor with its dtype; what
    has no JSON form as an object no step accepts (as the original was not accepted)."""
    if isinstance(answer, torch.Tensor):
        return {TENSOR: answer.detach().cpu().tolist(), "dtype": str(answer.dtype)[6:]}
    try:
        return plain(answer)
    except TypeError:
        return {NOT_PLAIN: type(answer).__name__}


def replayed_answer(recorded: Any) -> Any:
    if isinstance(recorded, dict) and TENSOR in recorded:
        dtype = getattr(torch, str(recorded.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise ReplayMismatch(f"a recorded tensor's dtype {recorded.get('dtype')!r}")
        return torch.tensor(recorded[TENSOR], dtype=dtype)
    return recorded


class ReplayMismatch(Exception):
    """A replayed function was asked something its recorded answers do not hold."""


class Replay:
    """A learner's function replayed from its recorded answers, `answers[rank]` a list of
    [arguments, answer] in call order. The trial is deterministic given the answers, so the
    replay is asked exactly what the learner's function was; anything else means the answers
    were not recorded by `attempt` (a ReplayMismatch)."""

    def __init__(self, answers: list[list[list[Any]]]) -> None:
        self.answers, self.calls = answers, 0

    def __call__(self, *args: Any) -> Any:
        from fsdp_lab.cluster import rank

        mine = self.answers[rank()]
        if self.calls >= len(mine) or plain(list(args)) != mine[self.calls][0]:
            raise ReplayMismatch(f"call {self.calls + 1} on rank {rank()} is not in the reply")
        self.calls += 1
        return replayed_answer(mine[self.calls - 1][1])
