"""The process groups a sharding strategy runs on: one group of every rank (1-D), or the two of
a 2-D (replicate x shard) mesh for hybrid sharding.

[Note: the 2-D mesh] With R·S ranks laid out as R rows of S (global rank g = r·S + s), a
*shard group* is a row — the S ranks of one "node", which split the parameters between them
(ZeRO-3 or ZeRO-2 inside) — and a *replicate group* is a column — the R ranks holding the same
shard, one per node, which all-reduce its gradient. PyTorch names the dimensions the same
way: ``init_device_mesh(device_type, (R, S), mesh_dim_names=("replicate", "shard"))``, which
`fully_shard` reads as HSDP and FSDP1 takes with ``ShardingStrategy.HYBRID_SHARD``.

Every check here reads only its arguments and the world size, so a bad mesh is refused on
every rank before any group is made or message sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from fsdp_lab.choices import Strategy
from fsdp_lab.cluster.where import device as placed_device


@dataclass(frozen=True)
class Groups:
    """Where a sharded model's collectives go. `group` shards (S = `shard_size` ranks, this
    rank's index `shard_rank` in it; every rank unless hybrid); `replicate_group` (size
    `replicas`) all-reduces the shard's gradient — None unless hybrid. `sync_group` is where
    rank 0's values go for ``sync_module_states``."""

    group: dist.ProcessGroup | None
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None = None
    replicas: int = 1

    @property
    def sync_group(self) -> dist.ProcessGroup | None:
        # Hybrid: every replica must start alike, so rank 0 broadcasts to the whole world; a
        # shard group other than the first does not even hold global rank 0.
        return None if self.replicate_group is not None else self.group


def mesh_shape(mesh: Any, world: int) -> tuple[int, int]:
    """(R, S) of a hybrid mesh given as a tuple/list of two positive ints whose product is the
    world size; a ValueError naming the value and the fix otherwise."""
    s = next((d for d in range(2, world + 1) if world % d == 0), 1)  # smallest real shard group
    fix = f"mesh=({world // s}, {s})"
    if not (isinstance(mesh, (tuple, list)) and len(mesh) == 2):
        raise ValueError(
            f"mesh={mesh!r}: a hybrid mesh is two ints (R replicas, S ranks per shard group). "
            f"Fix: {fix}"
        )
    for d in mesh:
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(
                f"mesh={tuple(mesh)!r}: dimension {d!r} is not a positive int. Fix: {fix}"
            )
    r, s = mesh
    if r * s != world:
        raise ValueError(
            f"mesh={tuple(mesh)!r} has {r}x{s}={r * s} ranks but the world has {world}: "
            f"R·S must equal the world size. Fix: {fix}"
        )
    return r, s


def resolve(mesh: Any, strategy: Strategy) -> Groups:
    """The groups of `strategy` on `mesh`: None (every rank), a 1-D DeviceMesh or ProcessGroup
    spanning every rank; for "hybrid"/"hybrid_zero2", (R, S) or a 2-D DeviceMesh."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if strategy.replicated:
        return _hybrid(mesh, strategy.name, world, rank)
    strategy = strategy.name  # below: only named in messages
    if isinstance(mesh, (tuple, list)):
        raise ValueError(
            f"mesh={tuple(mesh)!r} with strategy={strategy!r}: a (replicate, shard) mesh is "
            f"read by the hybrid strategies only, {strategy!r} shards over every rank. Fix: "
            f"strategy='hybrid' (or 'hybrid_zero2'), or mesh=None"
        )
    if mesh is None:
        return Groups(None, world, rank)
    if mesh is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"rank {rank} is not in the given mesh/process group: it must span every rank"
        )
    if isinstance(mesh, dist.ProcessGroup):
        size, group = dist.get_world_size(mesh), mesh
    elif hasattr(mesh, "get_group") and hasattr(mesh, "ndim"):  # a DeviceMesh
        if mesh.ndim != 1:
            raise ValueError(
                f"mesh has {mesh.ndim} dimensions; strategy={strategy!r} shards over a 1-D "
                "mesh. Fix: strategy='hybrid' for a 2-D (replicate, shard) mesh"
            )
        size, group = mesh.size(), mesh.get_group()
    else:
        raise TypeError(f"mesh={mesh!r}: expected None, a 1-D DeviceMesh or a ProcessGroup")
    if size != world:
        raise ValueError(
            f"mesh has {size} ranks but the world has {world}: a 1-D sharding mesh must span "
            f"every rank. Fix: init_device_mesh(device_type, ({world},)), or mesh=None"
        )
    return Groups(group, world, rank)


def _hybrid(mesh: Any, strategy: str, world: int, rank: int) -> Groups:
    if mesh is None:
        s = next((d for d in range(2, world + 1) if world % d == 0), 1)
        raise ValueError(
            f"strategy={strategy!r} (HSDP) needs a 2-D mesh: (R replicas, S ranks per shard group). "
            f"Fix: mesh=({world // s}, {s}) — or strategy='full' to shard over every rank"
        )
    if hasattr(mesh, "get_group") and hasattr(mesh, "ndim"):  # a DeviceMesh
        if mesh.ndim != 2:
            raise ValueError(
                f"strategy={strategy!r} needs a 2-D (replicate, shard) DeviceMesh; this one "
                f"has {mesh.ndim} dimension(s). Fix: init_device_mesh(device_type, (R, S), "
                "mesh_dim_names=('replicate', 'shard')), or mesh=(R, S)"
            )
        r, s = mesh.shape
    else:
        r, s = mesh_shape(mesh, world)
        mesh = device_mesh(r, s)
    return Groups(
        group=mesh.get_group(1),
        shard_size=s,
        shard_rank=dist.get_rank(mesh.get_group(1)),
        replicate_group=mesh.get_group(0) if r > 1 else None,  # one replica: plain ZeRO
        replicas=r,
    )


def device_mesh(replicas: int, shard: int) -> Any:
    """PyTorch's 2-D DeviceMesh (replicate, shard) on this rank's device type — the one
    `fully_shard` and FSDP1's HYBRID_SHARD take, so every system runs on the same groups."""
    from torch.distributed.device_mesh import init_device_mesh

    # The placed device, not the backend: in the shared-GPU mode gloo carries CUDA tensors.
    return init_device_mesh(
        placed_device().type, (replicas, shard), mesh_dim_names=("replicate", "shard")
    )
