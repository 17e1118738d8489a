"""Exercise of the hsdp lab: the gradient reduce of hybrid sharding (`hsdp_reduce_grad`).

On an R x S mesh, each row of S ranks (a "node") shards the model between them and each column
of R ranks holds the same shard, one per replica. A unit's gradient is reduce-scattered inside
the shard group, then that *chunk* is all-reduced across the replicate group, and divided by
all R·S ranks. The learner's function runs as every unit's reduce inside the real hybrid
sharding (`ShardingSteps.reduce_grad_shard`, the same injection point as the sharding lab's
`reduce_scatter_grad`), for a few SGD steps, beside the reference step. Cases: a 2x2 mesh on 4
ranks, and a 1x2 mesh (one replica: `replicate_group` is None). The classic bugs: no all-reduce
across the replicas (the replicas drift apart: measured, their parameters differ after a step),
÷ the shard group's size instead of every rank's (each step R times too large), the whole
gradient all-reduced across the replicas before the reduce-scatter (right values, S times the
bytes over the slow link), and an all-reduce on `group=None` with one replica (None means every
rank to torch.distributed).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fsdp_lab import comm
from fsdp_lab.exercise import (
    Bug,
    Case,
    Exercise,
    Mismatch,
    at_least,
    close,
    ratio_hint,
    replicas_apart,
    trained_unlike,
)
from fsdp_lab.sharding.exercises.reduce_scatter_grad import STEPS, train_with
from fsdp_lab.sharding.mesh import device_mesh
from fsdp_lab.sharding.steps import reduce_grad_shard


def hsdp_reduce_grad(
    full_grad: torch.Tensor,
    shard_group: dist.ProcessGroup,
    replicate_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Reference: the mechanism's own step."""
    return reduce_grad_shard(full_grad, shard_group, replicate_group)


def _scatter(full_grad: torch.Tensor, shard_group: dist.ProcessGroup) -> torch.Tensor:
    out = torch.empty(full_grad.numel() // dist.get_world_size(shard_group), dtype=full_grad.dtype)
    comm.reduce_scatter_tensor(out, full_grad, group=shard_group)
    return out


def _no_replica_all_reduce(full_grad, shard_group, replicate_group):  # noqa: ANN001, ANN202
    return _scatter(full_grad, shard_group).div_(dist.get_world_size(shard_group))


def _divide_by_shard_group(full_grad, shard_group, replicate_group):  # noqa: ANN001, ANN202
    out = _scatter(full_grad, shard_group)
    if replicate_group is not None:
        comm.all_reduce(out, group=replicate_group)
    return out.div_(dist.get_world_size(shard_group))


def _all_reduce_whole_gradient(full_grad, shard_group, replicate_group):  # noqa: ANN001, ANN202
    ranks = dist.get_world_size(shard_group)
    if replicate_group is not None:
        full_grad = full_grad.clone()
        comm.all_reduce(full_grad, group=replicate_group)
        ranks *= dist.get_world_size(replicate_group)
    return _scatter(full_grad, shard_group).div_(ranks)


def _all_reduce_on_none(full_grad, shard_group, replicate_group):  # noqa: ANN001, ANN202
    out = _scatter(full_grad, shard_group)
    comm.all_reduce(out, group=replicate_group)
    return out.div_(dist.get_world_size(shard_group) * dist.get_world_size(replicate_group))


# -- on every rank ---------------------------------------------------------------------------


def trial(fn: Any, case: Case) -> dict:
    replicas, size = case.params["mesh"]
    mesh = device_mesh(replicas, size)  # the (replicate, shard) DeviceMesh
    across = comm.group_label(mesh.get_group(0)) if replicas > 1 else None
    # `across`: the label of this rank's replicate group in the byte counts
    return {**train_with(fn, case, "hybrid", mesh), "across": across}


# -- in the notebook -------------------------------------------------------------------------


def judge(got_all: list[Any], expected: list[Any], case: Case) -> Mismatch | None:
    replicas, size = case.params["mesh"]
    world = case.world_size
    apart = replicas_apart(
        got_all,
        expected,
        [[r * size + s for r in range(replicas)] for s in range(size)],  # one shard, R copies
        STEPS,
        "each replica averaged only its own shard group's gradients: after the reduce-scatter, "
        "all-reduce the chunk across replicate_group.",
    )
    if apart:
        return apart

    def hint(r: int) -> str:
        got = got_all[r]["first_grad"]
        everyone = [expected[q]["first_grad"] for q in range(world)]
        if replicas == 1 and close(got, [sum(v) / world for v in zip(*everyone, strict=True)]):
            return (
                "with a single replica replicate_group is None, and group=None means every "
                "rank to torch.distributed: skip the all-reduce when it is None."
            )
        return ratio_hint(
            got,
            expected[r]["first_grad"],
            {
                float(replicas): f"÷ the shard group's size ({size}), but the gradients of all "
                f"{world} ranks are in the sum: divide by shard size x replicas.",
                float(world): "missing ÷: the reduce-scatter and the all-reduce SUM; divide by "
                "every rank that contributed.",
            },
        )

    wrong = trained_unlike(got_all, expected, STEPS, hint, what="gradient chunk")
    if wrong:
        return wrong
    across = expected[0]["across"]
    if across is not None:
        got_b = got_all[0]["reduce_bytes"].get(across, 0.0)
        exp_b = expected[0]["reduce_bytes"].get(across, 0.0)
        at_least(got_b, exp_b, f"bytes rank 0 moved in {across}")
        if got_b > 1.5 * exp_b:
            return Mismatch(
                f"values right, but rank 0 sent {got_b / exp_b:.2g}x the bytes across the "
                f"replicas ({across}) of the reference: {got_b:.0f} vs {exp_b:.0f} in "
                f"{STEPS} steps.",
                rows=[(f"bytes rank 0 moved in {across}", f"{exp_b:.0f}", f"{got_b:.0f}")],
                hint="the replicas need only the chunk: reduce-scatter inside the shard group "
                f"first, then all-reduce the 1/{size} chunk across replicate_group, not the "
                "whole gradient.",
            )
    return None


HSDP_REDUCE_GRAD = Exercise(
    name="hsdp_reduce_grad",
    lab="hsdp",
    title="Reduce a gradient on a 2-D (replicate x shard) mesh",
    statement=(
        "Hybrid sharding (HSDP) lays R·S ranks out as R replicas of S-rank shard groups: a "
        "shard group (a row, one node) splits each unit between its S ranks; a replicate group "
        "(a column) holds the same chunk once per replica. After a unit's backward every rank "
        "holds its own gradient of the whole unit (`full_grad`, flat, padded to a multiple of "
        "S). Write `hsdp_reduce_grad(full_grad, shard_group, replicate_group)`: return this "
        "rank's chunk (`full_grad.numel() // S` elements) of the mean over **all R·S ranks**. "
        "Reduce-scatter inside `shard_group` (the fast link), then all-reduce only that chunk "
        "across `replicate_group` (the slow link between nodes). `replicate_group` is None "
        "when there is a single replica. Use `comm.reduce_scatter_tensor` and `comm.all_reduce`."
    ),
    stub=(
        "def hsdp_reduce_grad(full_grad, shard_group, replicate_group):\n"
        '    """This rank\'s chunk of the mean of `full_grad` over every rank of the mesh:\n'
        '    full_grad.numel() // dist.get_world_size(shard_group) elements."""\n'
    ),
    hints=(
        "Two sums: inside the shard group (reduce-scatter: each rank gets its chunk) and "
        "across the replicas (all-reduce of that chunk).",
        "The mean divides by every rank whose gradient is in the sum: "
        "dist.get_world_size(shard_group) x dist.get_world_size(replicate_group).",
        "`comm.all_reduce(t, group=None)` would sum over every rank: when `replicate_group` is "
        "None, there is nothing to all-reduce and only S ranks to divide by.",
    ),
    solution=hsdp_reduce_grad,
    trial=trial,
    judge=judge,
    cases=(
        Case(
            "4 ranks as a 2x2 mesh: 2 replicas of 2-rank shard groups",
            4,
            {"mesh": (2, 2), "model": "mlp", "dim": 8},
        ),
        Case(
            "2 ranks as a 1x2 mesh: one replica (replicate_group is None)",
            2,
            {"mesh": (1, 2), "model": "mlp", "dim": 8},
        ),
    ),
    bugs=(
        Bug(
            "no-replica-all-reduce",
            "replicas not all-reduced",
            _no_replica_all_reduce,
            "each replica trains on its own ranks' batches only: the replicas' parameters "
            "drift apart from the first step",
        ),
        Bug(
            "shard-group-size",
            "÷ shard-group size instead of every rank",
            _divide_by_shard_group,
            "each step is R times too large: training drifts from one-process training",
        ),
        Bug(
            "whole-gradient",
            "the whole gradient all-reduced across replicas",
            _all_reduce_whole_gradient,
            "the values are right, but S times the bytes cross the slow link between nodes",
        ),
        Bug(
            "group-none",
            "all-reduce on replicate_group=None",
            _all_reduce_on_none,
            "with a single replica the all-reduce runs over every rank and mixes the chunks",
        ),
    ),
    points=3,
    minutes=15,
)
