"""Exercise of the sharding lab (FSDP / ZeRO-3): the first of the steps that make sharding work
(`ShardingSteps`), and the training the reduce exercises share (`train_with`, used by the HSDP one too).

`reduce_scatter_grad` (here) — after a unit's backward, each rank holds the gradient of the
*whole* unit, computed on its own batch; it must keep only its chunk of the *average* over the
ranks. The learner's function runs as the unit's reduce (`ShardingSteps.reduce_grad_shard`, called by `ShardedUnit.reduce_grad`) for a few
SGD steps, beside the same training with the reference step. Cases: 2 ranks; 3 ranks, where
the units' sizes do not divide by 3 (padding); a GPT whose head is tied to its embedding. The
classic bugs: no ÷ world size (each step N times too large), another rank's chunk, and an
all-reduce followed by a slice (right values, twice the bytes of a reduce-scatter).

`free_unsharded` (`free_unsharded.py`) — free the gathered parameters after forward for real,
judged on the memory trace and the gradients.

`unit_to_prefetch` (`unit_to_prefetch.py`) — which unit to gather while another runs its
backward, judged on the all-gathers backward had to wait for.

The hybrid lab's `hsdp_reduce_grad` (`hsdp/exercises/hsdp_reduce_grad.py`) runs in the same reduce, with replicas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab import comm, reference
from fsdp_lab.exercise import (
    Bug,
    Case,
    Exercise,
    Mismatch,
    at_least,
    close,
    expect_tensor,
    ratio_hint,
    trained_unlike,
)
from fsdp_lab.models import Block, MLPBlock, MLPStack, tiny_gpt
from fsdp_lab.sharding import shard, sharding_state
from fsdp_lab.sharding.steps import ShardingSteps, reduce_grad_shard

STEPS = 3
LR = 0.5  # plain SGD: a wrong factor in the gradient shows in the loss within a few steps
ReduceStep = Callable[[torch.Tensor, Any, Any], torch.Tensor]


def reduce_scatter_grad(full_grad: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Reference: the mechanism's own step (reduce-scatter, ÷ the group's size), one replica."""
    return reduce_grad_shard(full_grad, group, None)


def _no_divide(full_grad: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = torch.empty(full_grad.numel() // dist.get_world_size(group), dtype=full_grad.dtype)
    comm.reduce_scatter_tensor(out, full_grad, group=group)
    return out


def _next_rank_chunk(full_grad: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    total = full_grad.clone()
    comm.all_reduce(total, group=group)
    return total.chunk(n)[(r + 1) % n] / n


def _all_reduce_then_slice(full_grad: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    total = full_grad.clone()
    comm.all_reduce(total, group=group)
    return total.chunk(n)[r] / n


# -- on every rank ---------------------------------------------------------------------------


def checked(step: ReduceStep) -> ReduceStep:
    """`step` with its result's shape and dtype checked before the unit uses it."""

    def reduce(full_grad: torch.Tensor, shard_group: Any, replicate_group: Any) -> torch.Tensor:
        got = step(full_grad, shard_group, replicate_group)
        size = dist.get_world_size(shard_group)
        like = torch.empty(full_grad.numel() // size, dtype=full_grad.dtype)
        return expect_tensor(
            got, like, f"this rank's chunk of a {full_grad.numel()}-element gradient"
        )

    return reduce


def build_model(case: Case) -> nn.Module:
    """The case's model, the same on every rank (seeded), and its wrap units."""
    if case.params["model"] == "gpt":  # head tied to the token embedding, both in the root
        return tiny_gpt(n_layers=2, dim=16, vocab_size=32, seq_len=4)
    torch.manual_seed(0)
    return MLPStack(vocab_size=16, dim=case.params["dim"], n_layers=2)


def train_with(step: ReduceStep, case: Case, strategy: str = "full", mesh: Any = None) -> dict:
    """`STEPS` SGD steps with `step` as every unit's gradient reduce: losses, this rank's
    gradient chunk of step 1 and parameters after the last step (every unit, flat), and the
    bytes each process group moved."""
    model = build_model(case)
    # The injection point: every unit's gradient reduce is the learner's step.
    steps = ShardingSteps(reduce_grad_shard=checked(step))
    shard(model, units={Block, MLPBlock}, strategy=strategy, mesh=mesh, steps=steps)
    state = sharding_state(model)
    if case.params.get("padded") and not any(u.flat.padding for u in state.units):
        raise ValueError(f"case {case.label!r} promises padding, but every unit divides")
    first_grad: list[float] = []

    def keep_first_grad(k: int) -> None:
        if k == 0:
            first_grad.extend(torch.cat([u.flat_shard_grad() for u in state.units]).tolist())

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with comm.CommLog() as log:
        losses = reference.train_steps(
            model,
            optimizer,
            STEPS,
            seq_len=4,
            rank=dist.get_rank(),
            world=dist.get_world_size(),
            on_step=keep_first_grad,
        )
    moved: dict[str, float] = {}
    for rec in log.records:
        if rec.op != "all_gather_into_tensor":  # the gradients' reductions only
            moved[rec.group] = moved.get(rec.group, 0.0) + rec.bytes
    weights = torch.cat([u.flat.shard.detach() for u in state.units])
    return {
        "losses": losses,
        "first_grad": first_grad,
        "weights": weights.tolist(),
        "reduce_bytes": moved,
    }


def trial(fn: Any, case: Case) -> dict:
    # the whole world as the one shard group: the learner's step takes (full_grad, group)
    return train_with(
        lambda full_grad, shard_group, replicate_group: fn(full_grad, shard_group),
        case,
        mesh=dist.group.WORLD,
    )


# -- in the notebook -------------------------------------------------------------------------


def judge(got_all: list[Any], expected: list[Any], case: Case) -> Mismatch | None:
    n = case.world_size

    def hint(r: int) -> str:
        got = got_all[r]["first_grad"]
        other = next(
            (q for q in range(n) if q != r and close(got, expected[q]["first_grad"])), None
        )
        if other is not None:
            return (
                f"you returned rank {other}'s chunk: rank r keeps chunk r, "
                "dist.get_rank(group) — which reduce_scatter_tensor hands each rank by itself."
            )
        return ratio_hint(
            got,
            expected[r]["first_grad"],
            {
                float(n): f"missing ÷ world size: the reduce-scatter SUMS the {n} ranks' "
                f"gradients; divide the chunk by dist.get_world_size(group).",
                1.0 / n: "divided twice: divide once, by the group's size, before or after the "
                "reduce-scatter.",
            },
            "Rank r keeps chunk r of the SUM over the group (reduce_scatter_tensor), divided "
            "by the group's size: compare your chunk with the table.",
        )

    wrong = trained_unlike(got_all, expected, STEPS, hint, what="gradient chunk")
    if wrong:
        return wrong
    got_bytes = sum(got_all[0]["reduce_bytes"].values())
    exp_bytes = sum(expected[0]["reduce_bytes"].values())
    at_least(got_bytes, exp_bytes, "bytes rank 0 sent to reduce the gradients")
    if got_bytes > 1.5 * exp_bytes:
        return Mismatch(
            f"values right, but reducing the gradients moved {got_bytes / exp_bytes:.2g}x the "
            f"bytes of a reduce-scatter ({got_bytes:.0f} bytes vs {exp_bytes:.0f} per rank, "
            f"{STEPS} steps).",
            rows=[
                ("bytes sent by rank 0 for the gradients", f"{exp_bytes:.0f}", f"{got_bytes:.0f}")
            ],
            hint="an all-reduce sends every rank the whole sum (a reduce-scatter and an "
            "all-gather) only to throw most of it away: comm.reduce_scatter_tensor leaves each "
            "rank its own chunk.",
        )
    return None


REDUCE_SCATTER_GRAD = Exercise(
    name="reduce_scatter_grad",
    lab="shard",
    title="Reduce-scatter a unit's gradient into this rank's averaged chunk",
    statement=(
        "After a unit's backward, every rank holds the gradient of the **whole** unit, computed "
        "on its own part of the batch, as one flat tensor padded to a multiple of the number "
        "of ranks N. ZeRO-3 keeps only a 1/N chunk of each parameter and of its optimizer "
        "state, so each rank needs only **its chunk of the average** of the N gradients. Write "
        "`reduce_scatter_grad(full_grad, group)`: return a new 1-D tensor of "
        "`full_grad.numel() // N` elements, rank r's chunk (r = `dist.get_rank(group)`) of the "
        "element-wise mean of `full_grad` over the ranks of `group`. It runs as the reduce of "
        "every unit of a sharded model, for a few SGD steps. Use "
        "`comm.reduce_scatter_tensor(out, full_grad, group=group)` (counted, like "
        "`dist.reduce_scatter_tensor`)."
    ),
    stub=(
        "def reduce_scatter_grad(full_grad, group):\n"
        '    """This rank\'s chunk of the mean of `full_grad` over `group`: a new tensor of\n'
        '    full_grad.numel() // dist.get_world_size(group) elements."""\n'
    ),
    hints=(
        "A reduce-scatter adds the N ranks' tensors and leaves rank r only chunk r of the "
        "sum: one message per rank of 1/N of the gradient, half an all-reduce.",
        "`comm.reduce_scatter_tensor(out, full_grad, group=group)` writes into `out`, which "
        "you allocate: `torch.empty(full_grad.numel() // n, dtype=full_grad.dtype)`.",
        "Gloo has no AVG: after the reduce-scatter, divide `out` by "
        "n = `dist.get_world_size(group)`, and return it.",
    ),
    solution=reduce_scatter_grad,
    trial=trial,
    judge=judge,
    cases=(
        Case(
            "2 ranks, an MLP of 2 blocks (a unit each), 3 SGD steps", 2, {"model": "mlp", "dim": 8}
        ),
        Case(
            "3 ranks, unit sizes not divisible by 3 (padded)",
            3,
            {"model": "mlp", "dim": 8, "padded": True},
        ),
        Case("2 ranks, a GPT whose head is tied to its embedding", 2, {"model": "gpt"}),
    ),
    bugs=(
        Bug(
            "no-divide",
            "missing ÷ world size",
            _no_divide,
            "each rank keeps the SUM of the gradients, N times the mean: every step is N times "
            "too large and training drifts from one-process training",
        ),
        Bug(
            "other-chunk",
            "another rank's chunk",
            _next_rank_chunk,
            "each rank updates its parameters with the gradient of another rank's slice",
        ),
        Bug(
            "all-reduce",
            "all-reduce, then slice",
            _all_reduce_then_slice,
            "the values are right, but every rank receives the whole summed gradient only to "
            "keep 1/N of it: twice the bytes of a reduce-scatter",
        ),
    ),
    points=2,
    minutes=10,
)
