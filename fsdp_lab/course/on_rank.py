"""What runs on each rank during a check: the learner's function under a watch.

Two things a learner's function can do that a plain `cluster.run` would report badly:

- return a tensor of the wrong shape or dtype: `expect_tensor` stops the trial there with a
  `WrongOutput` that names what was expected, before the value reaches a collective (where a
  wrong size would hang every rank, not explain anything);
- hang (a collective that one rank never calls, a loop that never ends): `attempt` arms
  `faulthandler` to write every thread's stack to a file shortly before the time limit, so the
  verdict can show *where* the rank was stuck, not only that it was.

What a trial measured leaves the rank as a JSON text (`as_json`): plain data, the same whether
the judge sits in this notebook or in a grading process the learner's code never touched.
"""

from __future__ import annotations

import faulthandler
import json
from collections.abc import Callable
from typing import Any

import torch

from fsdp_lab.course.exercise import Case

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


def as_json(value: Any) -> str:
    return json.dumps(plain(value))


def attempt(
    trial: Callable[..., Any],
    fn: Callable[..., Any],
    case: Case,
    stack_file: str,
    dump_after: float,
) -> str:
    """Run one trial on this rank and return what it measured as JSON; if it is still running
    after `dump_after` seconds, write every thread's stack to `stack_file` (the driver reads it
    if the call then times out)."""
    from fsdp_lab.cluster import rank, rank_threads

    # rank_threads: the cores shared by the ranks. N ranks x torch's default thread count
    # oversubscribe a laptop's cores and made checks several times slower. Every run (the
    # learner's, the reference's, in whatever process) uses the same threads, so values compare.
    with open(stack_file.format(rank=rank()), "w") as out, rank_threads():
        faulthandler.dump_traceback_later(dump_after, file=out)
        try:
            outcome = trial(fn, case)
        finally:
            faulthandler.cancel_dump_traceback_later()
    return as_json(outcome)
