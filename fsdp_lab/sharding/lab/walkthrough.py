"""One unit through one FSDP step, stage by stage, on real ranks: who holds what, measured.

The lab (`measure.py`) trains a whole model; this walkthrough slows one step down on a tiny
unit whose values say where they came from — parameter ``a`` holds 1, 2, …, ``b`` 11, 12, …,
``c`` 21, 22, … — and stops after every stage to record what each rank holds. The stages are
the ones `ShardedUnit` runs from its hooks, called here one at a time — the free and the
reduce-scatter are the mechanism's own steps (`fsdp_lab.sharding.steps`), the very functions
`shard()` calls, so what this walkthrough measures is what the mechanism does:

    flatten         a, b, c -> one flat buffer, padded to a multiple of N
    shard           rank r keeps flat[r*S : (r+1)*S]                 (the only persistent copy)
    gather          all-gather: every rank holds the full flat buffer again
    compute         forward + backward on the rank's own data -> unsharded gradient
    free            steps.free_unsharded: the unsharded buffer's storage is resized to 0 bytes
    reduce-scatter  steps.reduce_grad_shard: rank r keeps shard r of the gradient summed over
                    ranks, divided by N
    optimizer step  SGD on the shard: shard - lr * grad

Rank r's batch is the single number x = r + 1 (as in the collectives lab, values say where
they came from) and the toy loss is ``x · ½‖p‖²``: its gradient ``x · p`` shows both the
parameter values that were gathered and the data the rank saw, and the average over ranks is
the gradient of the whole batch [1, …, N], what one process would compute. The pictures of
each stage and the table of the whole step are `report.stage_figure` / `report.stage_table`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from fsdp_lab import comm
from fsdp_lab.cluster import AttachedCluster, Cluster, rank, world_size
from fsdp_lab.sharding import steps
from fsdp_lab.sharding.flat_param import FlatParameter
from fsdp_lab.sharding.lab.measure import flat_layout

STAGES: dict[str, str] = {
    "flatten": "the unit's parameters, concatenated and padded with 0 to a multiple of N",
    "shard": "rank r keeps slice r, the only copy of the parameters that persists",
    "gather": "every rank holds the full flat parameters again",
    "compute": "forward + backward on each rank's own batch: a different full gradient per rank",
    "free": "the unsharded parameters' storage is resized to 0 bytes; the shard stays",
    "reduce-scatter": "rank r keeps slice r of the gradient averaged over ranks",
    "optimizer step": "SGD on the shard alone: shard - lr * averaged gradient",
}


class TaggedUnit(nn.Module):
    """1-D parameters a, b, c, … filled with 1, 2, … / 11, 12, … / 21, 22, …; loss x · ½‖p‖²."""

    def __init__(self, numel_per_param: tuple[int, ...] = (3, 2, 2)) -> None:
        super().__init__()
        for i, n in enumerate(numel_per_param):
            values = torch.arange(1, n + 1, dtype=torch.float32) + 10 * i
            self.register_parameter("abcdefgh"[i], nn.Parameter(values))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B,) this rank's batch
        return x.mean() * sum(0.5 * (p * p).sum() for p in self.parameters())  # grad: x̄ * p


def _walk_on_rank(numel_per_param: tuple[int, ...], lr: float) -> dict[str, Any]:
    """Runs on every rank: one step of one unit, recording what this rank holds after each stage."""
    r, n = rank(), world_size()
    unit = TaggedUnit(numel_per_param)
    names, params = zip(*unit.named_parameters(), strict=True)
    parameters = [[float(v) for v in p.detach()] for p in params]  # before: a, b, c
    held: dict[str, list[float]] = {}
    storage: dict[str, int] = {}  # bytes of the unsharded buffer's storage, measured
    moved: dict[str, float] = {}
    ops: dict[str, list[str]] = {}  # the collectives each stage called, as comm counted them

    def record(stage: str, tensor: torch.Tensor) -> None:
        held[stage] = [float(v) for v in tensor.detach().reshape(-1)]
        storage[stage] = flat.unsharded.untyped_storage().nbytes()

    # flatten + shard: the constructor pads the flat buffer and keeps this rank's slice.
    flat = FlatParameter(list(names), list(params), shard_rank=r, shard_size=n)
    record("flatten", flat.flatten(dict(unit.named_parameters())))
    record("shard", flat.shard)

    # gather: refill the unsharded storage from every rank's shard.
    flat.alloc_unsharded()
    with comm.CommLog() as log, torch.no_grad():
        comm.all_gather_into_tensor(flat.unsharded.data, flat.shard.detach())
    moved["gather"], ops["gather"] = sum(log.bytes_by_op().values()), list(log.bytes_by_op())
    record("gather", flat.unsharded)

    # compute: the module sees views into the gathered buffer; rank r's slice of the batch.
    global_batch = torch.arange(1, n + 1, dtype=torch.float32)  # (N,) = [1, 2, ..., N]
    x = global_batch[r : r + 1]  # (1,) this rank's data: r + 1
    views = dict(zip(names, flat.views(), strict=True))
    torch.func.functional_call(unit, views, (x,)).backward()
    record("compute", flat.unsharded.grad)  # the views' gradients, summed into (padded,)

    # free: the parameters' storage goes to 0 bytes (the views stay valid Python objects).
    steps.free_unsharded(flat.unsharded)  # the mechanism's post-forward step
    record("free", flat.shard)

    # reduce-scatter: sum over ranks, keep shard r, divide by N; the full gradient is dropped.
    with comm.CommLog() as log, torch.no_grad():
        shard_grad = steps.reduce_grad_shard(flat.unsharded.grad, None)  # post-backward step
    moved["reduce-scatter"] = sum(log.bytes_by_op().values())
    ops["reduce-scatter"] = list(log.bytes_by_op())
    flat.shard.grad, flat.unsharded.grad = shard_grad, None
    record("reduce-scatter", flat.shard.grad)

    # optimizer step: a plain torch optimizer that only ever sees the shard.
    torch.optim.SGD([flat.shard], lr=lr).step()
    record("optimizer step", flat.shard)
    layout = {"names": list(names), **flat_layout(flat), "padding": flat.padding}
    return {
        "held": held,
        "storage": storage,
        "moved": moved,
        "ops": ops,
        "batch": x.tolist(),
        "parameters": parameters,
        "layout": layout,
    }


def run(
    cluster: Cluster | AttachedCluster,
    numel_per_param: tuple[int, ...] = (3, 2, 2),
    lr: float = 0.2,
) -> dict[str, Any]:
    """Run one step of one tiny unit on every rank of `cluster`, stopping after each stage.

    Args:
        cluster: live ranks (2 or more: one rank has nothing to shard).
        numel_per_param: sizes of the unit's parameters (at most 8).
        lr: SGD learning rate of the optimizer step.

    Returns a dict: ``stages`` (name -> ``rows``, one list of floats per rank, ready for
    `report.stage_figure`; ``explanation``; ``unsharded_storage_bytes`` and
    ``comm_bytes`` and ``collectives`` per rank), ``parameters`` (each rank's original a, b, c), ``batches``
    and the flat ``layout`` (numel, padded_numel, padding, shard_numel).
    """
    if cluster.world_size < 2:
        raise ValueError("the walkthrough needs 2 or more ranks: one rank has nothing to shard")
    if not 1 <= len(numel_per_param) <= 8 or min(numel_per_param) < 1:
        raise ValueError(f"numel_per_param={numel_per_param!r}: 1 to 8 sizes, each >= 1")
    per_rank = cluster.run(_walk_on_rank, tuple(numel_per_param), lr)
    stages = {
        name: {
            "rows": [p["held"][name] for p in per_rank],
            "explanation": why,
            "unsharded_storage_bytes": [p["storage"][name] for p in per_rank],
            "comm_bytes": [p["moved"].get(name, 0.0) for p in per_rank],
            "collectives": [p["ops"].get(name, []) for p in per_rank],
        }
        for name, why in STAGES.items()
    }
    return {
        "world_size": cluster.world_size,
        "lr": lr,
        "layout": per_rank[0]["layout"],
        "parameters": [p["parameters"] for p in per_rank],
        "batches": [p["batch"] for p in per_rank],
        "stages": stages,
    }
