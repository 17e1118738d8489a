"""The five steps of a unit's life that a learner writes: plain functions, and the frozen
`ShardingSteps` that carries them into the mechanism.

    pre-forward    cast_floats((args, kwargs), dtype)        mixed precision: inputs cast in,
    post-forward   cast_floats(output, dtype)                and outputs cast out
    post-forward   free_unsharded(buffer)                    ZeRO-3: the gathered bytes go
    pre-backward   regather(buffer, all_gather)              and come back for backward
                   unit_to_prefetch(forward_order, position) which unit to gather meanwhile
    post-backward  reduce_grad_shard(full_grad, groups...)   this rank's averaged shard

`shard(model, ..., steps=ShardingSteps(...))` takes them by keyword; the default is these
reference functions. A course exercise passes its learner's function in one field — the seam
FSDP2 would call a hook, not an attribute written after wrap. Nothing here knows about units:
each step sees tensors, names and process groups only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from fsdp_lab import comm


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """`tree` with each floating-point tensor in it cast to `dtype`, and nothing else changed.

    Args:
        tree: a unit's inputs as its forward receives them, `(args, kwargs)` (a tuple and a
            dict, the tensors anywhere inside), or its output (a tensor, or tensors nested in
            tuples, lists and dicts).
        dtype: what the unit computes in (`param_dtype`, for the inputs) or hands on
            (`output_dtype`, for the output); the unit calls no cast when its policy says None.

    Token ids and masks are integer or bool tensors: they stay as they are. `t.to(dtype)` keeps
    the tensor in autograd's graph, so the gradient flows back through the cast.
    """
    cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
    return tree_map_only(torch.Tensor, cast, tree)


def free_unsharded(buffer: torch.Tensor) -> None:
    """Free the bytes of a unit's gathered flat parameter after its forward (ZeRO-3).

    Args:
        buffer: (padded,) the unit's unsharded flat parameter. Its *storage* is resized to 0
            bytes and the tensor is kept: autograd saved views of it for backward, and
            `regather` refills that same storage.
    """
    buffer.untyped_storage().resize_(0)


def regather(buffer: torch.Tensor, all_gather: Callable[[], None]) -> None:
    """Make a unit's full parameters available again before its backward.

    Args:
        buffer: (padded,) the unit's unsharded flat parameter: 0 bytes if `free_unsharded` ran.
        all_gather: allocates the buffer's storage and all-gathers every rank's shard into it
            (a no-op when the parameters are there already or on their way, prefetched).
    """
    all_gather()


def unit_to_prefetch(forward_order: list[str], position: int) -> str | None:
    """The unit to gather while the unit at `position` of `forward_order` runs its backward.

    Args:
        forward_order: the units' names in the order their forwards *ended* in this step (the
            root, which encloses all the others, last; a unit of several modules once per
            member call).
        position: where the unit whose backward has just started sits in it.

    Backward runs the units in the reverse of that order, so the next one to need its
    parameters is the one whose forward ended just before; none before the first.
    """
    return forward_order[position - 1] if position > 0 else None


def reduce_grad_shard(
    full_grad: torch.Tensor,
    shard_group: dist.ProcessGroup | None,
    replicate_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """This rank's shard of the unit's gradient, averaged over every rank that computed one.

    Args:
        full_grad: (padded,) this rank's gradient of the whole unit, flat, padded to a multiple
            of the shard group's size S.
        shard_group: the S ranks that split the unit; this rank keeps chunk `rank in group`.
        replicate_group: hybrid sharding only: the R ranks holding the same chunk, one per
            replica (None: a single replica).

    Returns (padded / S,): the sum over the shard group (reduce-scatter), summed across the
    replicas (all-reduce of the chunk, not of the whole gradient), divided by R·S.
    """
    size = dist.get_world_size(shard_group)
    out = torch.empty(full_grad.numel() // size, dtype=full_grad.dtype, device=full_grad.device)
    comm.reduce_scatter_tensor(out, full_grad, group=shard_group)
    if replicate_group is not None:
        comm.all_reduce(out, group=replicate_group)
        size *= dist.get_world_size(replicate_group)
    return out.div_(size)


@dataclass(frozen=True)
class ShardingSteps:
    """The steps every unit of one sharded model calls; each field defaults to the reference."""

    cast_floats: Callable[[Any, torch.dtype], Any] = cast_floats
    free_unsharded: Callable[[torch.Tensor], None] = free_unsharded
    regather: Callable[[torch.Tensor, Callable[[], None]], None] = regather
    unit_to_prefetch: Callable[[list[str], int], str | None] = unit_to_prefetch
    reduce_grad_shard: Callable[..., torch.Tensor] = reduce_grad_shard
