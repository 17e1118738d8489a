"""Exercise of the collectives lab: the averaging every data-parallel step depends on.

`all_reduce_mean` — average a gradient over the ranks of a group. It runs inside data-parallel
training (one model replica per rank, each on its own batch, gradients averaged before the
step), which must then match training on the whole batch in one process. The classic bugs:
SUM where the average was meant (the step is N times too large), and dividing by the world
size when the group is smaller (the step is too small on a subgroup, as in HSDP's replica
groups).

`gather_shards` (`gather_shards.py`) — rebuild a flat tensor from every
rank's padded shard, the all-gather of FSDP's unshard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab import comm
from fsdp_lab.exercise import (
    Bug,
    Case,
    Exercise,
    Mismatch,
    expect_tensor,
    ratio_hint,
    replicas_apart,
    trained_unlike,
)

STEPS = 3


def all_reduce_mean(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Reference: sum over the group's ranks, then divide by the group's size (not the world's)."""
    out = tensor.clone()
    comm.all_reduce(out, group=group)
    return out.div_(dist.get_world_size(group))


def _sum_only(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = tensor.clone()
    comm.all_reduce(out, group=group)
    return out


def _divide_by_world(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = tensor.clone()
    comm.all_reduce(out, group=group)
    return out.div_(dist.get_world_size())


def _model(width: int) -> nn.Module:
    torch.manual_seed(0)  # every replica starts from the same weights
    return nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, 2))


def _train(average: Any, case: Case, group: dist.ProcessGroup, rank_in_group: int) -> dict:
    """Data parallel on this rank: own batch, gradients averaged by `average`, SGD step."""
    model = _model(case.params["width"])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, first_grad = [], None
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank_in_group)  # this rank's batch
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            got = average(p.grad.clone(), group)
            p.grad = expect_tensor(got, p.grad, "the averaged gradient")
        if first_grad is None:
            first_grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        opt.step()
        losses.append(loss.item())
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"losses": losses, "weights": weights.tolist(), "first_grad": first_grad.tolist()}


def trial(fn: Any, case: Case) -> dict | None:
    members = case.params.get("group") or list(range(dist.get_world_size()))
    group = dist.new_group(members)  # every rank takes part in creating it
    me = dist.get_rank()
    if me not in members:
        return None  # not in the group: nothing to average
    return _train(fn, case, group, members.index(me))


def judge(got: list[Any], expected: list[Any], case: Case) -> Mismatch | None:
    ranks = [r for r, o in enumerate(expected) if o is not None]
    size = len(ranks)
    apart = replicas_apart(
        got,
        expected,
        [ranks],
        STEPS,
        "Every rank of the group must end with the same average — an all_reduce, not a reduce "
        "to one rank or a local division.",
    )
    return apart or trained_unlike(
        got,
        expected,
        STEPS,
        lambda r: ratio_hint(
            got[r]["first_grad"],
            expected[r]["first_grad"],
            {
                float(size): "SUM where the average was meant: divide the sum by the number "
                "of ranks in the group.",
                size / case.world_size: "divided by the world size, but this group has "
                f"{size} ranks: use dist.get_world_size(group).",
                1.0 / size: "divided twice: all_reduce sums; divide once, by the group's size.",
            },
        ),
        what="averaged gradient",
    )


ALL_REDUCE_MEAN = Exercise(
    name="all_reduce_mean",
    lab="collectives",
    title="Average a gradient over the ranks of a group",
    statement=(
        "Data-parallel training keeps one replica of the model per rank; each rank computes "
        "gradients on its own batch, and before the optimizer step every rank must hold the "
        "**average** of all ranks' gradients — the gradient of the whole batch. Write "
        "`all_reduce_mean(tensor, group)`: return a new tensor holding the element-wise mean of "
        "`tensor` over the ranks of `group`, the same on every rank of the group. `group` may "
        "be a subgroup of the world (HSDP averages over replica groups). Use "
        "`fsdp_lab.comm.all_reduce` (counted, like `torch.distributed.all_reduce`)."
    ),
    stub=(
        "def all_reduce_mean(tensor, group):\n"
        '    """The mean of `tensor` over the ranks of `group`, as a new tensor."""\n'
    ),
    hints=(
        "`comm.all_reduce(t, group=group)` adds every rank's `t` in place: afterwards each rank "
        "holds the SUM.",
        "Gloo has no AVG reduction: sum, then divide. By how many ranks? Those of `group`: "
        "`dist.get_world_size(group)`.",
        "Work on `tensor.clone()` so the caller's tensor is left as it was.",
    ),
    solution=all_reduce_mean,
    trial=trial,
    judge=judge,
    cases=(
        Case("2 ranks, a 5→4→2 MLP, 3 SGD steps", 2, {"width": 4}),
        Case("3 ranks, a 5→3→2 MLP (odd sizes)", 3, {"width": 3}),
        Case("ranks 0 and 2 of 3 as the group", 3, {"width": 3, "group": [0, 2]}),
    ),
    bugs=(
        Bug(
            "sum",
            "SUM where the average was meant",
            _sum_only,
            "each step is N times too large: the loss drifts from the one-process run, or diverges",
        ),
        Bug(
            "world-size",
            "÷ the world size on a subgroup",
            _divide_by_world,
            "on a group smaller than the world the step is too small: right on the full "
            "world, wrong on a subgroup",
        ),
    ),
    points=2,
    minutes=10,
)
