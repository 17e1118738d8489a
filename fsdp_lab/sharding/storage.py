"""Each unit's storage: its `FlatParameter` (this rank's shard) and the original parameters
turned into slices of it — step 4 of `shard()`.

    model with values        for each unit: flatten its parameters, keep shard r (and, under
                             sync_module_states, rank 0's values broadcast first)
    model on meta            ordinary init module by module, each parameter into its shard as
                             soon as it is made (`materialize.shard_in_build_order`), or every
                             shard generated directly from a counter-based init (`shard_init`)

Afterwards each original parameter is this rank's slice of it, a view into the flat shard
registered in its own slot (same name, same place in `named_parameters()`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from fsdp_lab import comm
from fsdp_lab.sharding.flat_param import FlatParameter, SliceValues
from fsdp_lab.sharding.materialize import (
    ParamInitFn,
    SliceInit,
    materialize_buffers,
    owning_modules,
    shard_in_build_order,
    to_empty_keeping_ties,
)
from fsdp_lab.sharding.policy import UnitPlan
from fsdp_lab.sharding.wrap import ParamRef, WrapPlan


@dataclass
class UnitStorage:
    """One unit's storage, before its hooks: what the unit and `install_whole_views` need."""

    flat: FlatParameter
    owners: list[list[tuple[nn.Module, str]]]  # per parameter: every (module, attribute) slot
    aliases: list[tuple[str, ...]]  # per parameter: every name it has (2+ when tied)
    params: list[nn.Parameter]  # per parameter: this rank's slice of it
    frozen: list[bool]


@dataclass
class StorageBuilder:
    """Makes the units' flat shards and, once each is filled, their per-parameter slices."""

    model: nn.Module
    plan: WrapPlan
    unit_plans: dict[str, UnitPlan]  # each unit's strategy, precision, offload
    shard_rank: int  # this rank's place in the shard group (a replicated unit: 0 of 1)
    shard_size: int
    device: torch.device | None  # a meta model's target; None: where the parameters are
    compute_device: torch.device | None  # offload: where units compute (None: as above)
    fill_nan: bool  # param_init_fn="empty": uninitialised, loudly
    template: torch.Tensor  # dtype and device of a unit left without parameters (the root)
    built: dict[str, UnitStorage] = field(default_factory=dict)

    def flat_of(
        self, unit: str, params: list[torch.Tensor], values: SliceValues | None
    ) -> FlatParameter:
        policy = self.unit_plans[unit]
        sharded = policy.strategy.sharded  # replicated: every rank keeps the whole unit
        return FlatParameter(
            names=[r.name for r in self.plan.params[unit]],
            params=params,
            shard_rank=self.shard_rank if sharded else 0,
            shard_size=self.shard_size if sharded else 1,
            compute_dtype=policy.compute_dtype,
            template=self.template,
            values=values,
            device=self.device,
            requires_grad=any(p.requires_grad for p in params),
            offload=policy.offload,
            compute_device=self.compute_device,
        )

    def finish(self, unit: str, flat: FlatParameter, frozen: list[bool]) -> UnitStorage:
        refs = self.plan.params[unit]
        if self.fill_nan and flat.shard.is_floating_point():
            with torch.no_grad():  # a forgotten init_weights() shows
                flat.shard.fill_(float("nan"))
        owners = [[(self.model.get_submodule(m), a) for m, a in r.owners] for r in refs]
        aliases = [tuple(f"{m}.{a}" if m else a for m, a in r.owners) for r in refs]
        params = _register_slices(flat, owners, frozen, unit)
        self.built[unit] = UnitStorage(flat, owners, aliases, params, frozen)
        return self.built[unit]


def build_storage(
    builder: StorageBuilder,
    *,
    init_fn: ParamInitFn,
    shard_init: SliceInit | None,
    sync_group: object | None,
    sync: bool,
) -> dict[str, UnitStorage]:
    """Every unit's storage, root first (`builder.plan.units`' order)."""
    model, plan, target = builder.model, builder.plan, builder.device
    if target is not None and shard_init is None:  # on meta: parameter by parameter
        shard_in_build_order(model, plan, builder, target, init_fn, sync_group, sync)
        return {name: builder.built[name] for name in plan.units}
    lookup = dict(model.named_parameters(remove_duplicate=False))
    for name in plan.units:
        refs = plan.params[name]
        params = [lookup[r.name] for r in refs]
        values = _slice_values(model, refs, shard_init, target, init_fn) if target else None
        sharded = builder.unit_plans[name].strategy.sharded
        if sync and target is None and sharded:  # rank 0's whole parameters, before cutting
            with torch.no_grad():
                for p in params:
                    comm.broadcast(p.data, src=0, group=sync_group)
        flat = builder.flat_of(name, params, values)
        if sync and target is None and not sharded:  # the whole unit in one message
            with torch.no_grad():
                comm.broadcast(flat.shard.data, src=0, group=sync_group)
        builder.finish(name, flat, [not p.requires_grad for p in params])
        del params
    if target is not None:
        materialize_buffers(model, target, init_fn, sync_group, sync)
    elif sync:
        with torch.no_grad():
            for b in model.buffers():
                comm.broadcast(b, src=0, group=sync_group)
    return builder.built


FLAT_PARAM = "flat_param"  # attribute of each unit's first module holding its shard (FSDP1)


def expose_flat_parameter(module: nn.Module, unit: UnitStorage) -> None:
    """FSDP1's view (`use_orig_params=False`): the unit's one flat shard is the parameter the
    optimizer sees, registered on its first module; the original parameters become plain
    attributes, set to views by the unit."""
    for owners in unit.owners:
        for owner, attr in owners:
            del owner._parameters[attr]  # from now on a view, set by the unit
    module.register_parameter(FLAT_PARAM, unit.flat.shard)


def _register_slices(
    flat: FlatParameter, owners: list[list[tuple[nn.Module, str]]], frozen: list[bool], unit: str
) -> list[nn.Parameter]:
    """Each original parameter becomes this rank's slice of it, a view into the flat shard,
    registered in its own slot (same name, same place in `named_parameters()`)."""
    params = []
    storage = flat.shard.detach()  # a view of it shares the shard's memory, not its autograd
    for segment, ref_owners, is_frozen in zip(flat.segments, owners, frozen, strict=True):
        a, b = flat.local_range(segment)
        piece = storage[a:b]
        if flat.shard_size == 1:  # replicated: the whole parameter, in its own shape (DDP)
            piece = piece.view(segment.shape)
        param = nn.Parameter(piece, requires_grad=not is_frozen)
        lengths = flat.slice_lengths(segment)
        if len(set(lengths)) > 1:  # a collective over it would wait forever: comm refuses it
            comm.mark_uneven(param, segment.name, lengths, unit)
        for module, attr in ref_owners:  # tied: one Parameter under every name, as before
            module._parameters[attr] = param
        params.append(param)
    return params


def _slice_values(
    model: nn.Module,
    refs: tuple[ParamRef, ...],
    shard_init: SliceInit,
    device: torch.device,
    init_fn: ParamInitFn,
) -> SliceValues:
    """The unit's slice initialiser; buffers of its modules are materialised on the way."""
    dtypes = {r.name: model.get_parameter(r.name).dtype for r in refs}
    for _, module in owning_modules(model, refs):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            # Its buffers need its own init (e.g. BatchNorm statistics); the parameters it also
            # fills are discarded: the shard comes from `shard_init`.
            to_empty_keeping_ties([module], device)
            init_fn(module)

    def values(name: str, shape: torch.Size, start: int, end: int) -> torch.Tensor:
        return shard_init.values(name, tuple(shape), start, end, dtype=dtypes[name], device=device)

    return values
