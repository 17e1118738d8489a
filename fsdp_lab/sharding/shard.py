"""`shard(model, ...)`: turn a model into FSDP/ZeRO units, in place.

    plan    = build_plan(model, units)          which modules are gathered together (validated:
                                                ties inside one unit) — before any message
    for each unit, root first:
        flat = FlatParameter(its parameters)    flatten, pad to a multiple of N, keep shard r
        each parameter -> its slice of flat     same name, a view into the shard: what
                                                model.parameters() yields and the optimizer
                                                steps (use_orig_params=False: one flat_param)
        ShardedUnit(...)                        hooks: gather -> compute -> free -> reduce

A model built on the meta device is materialised here, module by module in build order, so no
rank ever holds it whole (`materialize.py`: ordinary init, each parameter into its shard as
soon as it is initialised; or each shard generated directly).

`ShardingState` (`state.py`) is what the units share: the process group, the order units ran
in (recorded on the first step, used to prefetch), and the end-of-backward callback that
finalizes every unit.

Strategies (`fsdp_lab.theory`; Ψ parameters, N ranks, fp32 Adam):

    "none"       DDP: replicated, gradients all-reduced                  16Ψ per rank
    "optimizer"  ZeRO-1: optimizer state sharded, full gradients kept   8Ψ + 8Ψ/N
    "grad_op"    ZeRO-2: gradients sharded as soon as they are ready    4Ψ + 12Ψ/N
    "full"       ZeRO-3: parameters sharded too, gathered per unit      16Ψ/N + largest unit
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab import comm
from fsdp_lab.choices import ALL_SHARDING_STRATEGIES
from fsdp_lab.sharding import mesh as meshes
from fsdp_lab.sharding.checks import check_model, check_units
from fsdp_lab.sharding.flat_param import FlatParameter, SliceValues
from fsdp_lab.sharding.materialize import (
    EMPTY,
    ParamInitFn,
    SliceInit,
    concrete_device,
    materialize_buffers,
    owning_modules,
    reset_parameters,
    to_empty_keeping_ties,
    walk_build_order,
)
from fsdp_lab.sharding.state import ShardingState, attach_state
from fsdp_lab.sharding.unit import ShardedUnit
from fsdp_lab.sharding.whole_view import (
    WholeView,
    install_whole_views,
    remove_whole_views,
    whole_init_functions,
)
from fsdp_lab.tying import record_ties, recorded_ties
from fsdp_lab.wrap import Units, build_plan

FLAT_PARAM = "flat_param"  # attribute of each unit module holding its shard


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in `param_dtype` (all-gathered in it); reduce gradients in `reduce_dtype`.

    The shards, their gradients and the optimizer stay in the parameters' dtype (fp32).
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = torch.float32


def _target_device(device: torch.device | str | None) -> torch.device:
    """Where a meta model's shards go: `device`, else this rank's GPU under NCCL, else CPU."""
    if device is None:
        device = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return concrete_device(device)


def _freed_after_forward(
    units: list[str], policy: Any, asked: bool | Iterable[str] | None
) -> set[str]:
    """The units freed after forward. [Note: the root stays gathered] The root unit is the
    first to be gathered in forward and, holding the loss-side modules (a GPT's head), the
    first needed in backward: freeing it between the two passes and gathering it again costs
    one all-gather of the root per step and saves its bytes only for the instant between
    forward and backward. FSDP2 (`FSDPState._lazy_init`: the root's post-forward mesh is
    None) and FSDP1 (`_post_forward_reshard` skips the root) both keep it; so do we by
    default. notebooks/01_sharding.ipynb measures both choices."""
    if not policy.reshard_after_forward or asked is False:
        return set()
    if asked is None or asked is True:
        return set(units[1:])  # units[0] is the root
    free_after = set(asked)
    unknown = free_after - set(units)
    if unknown:
        raise ValueError(
            f"reshard_after_forward names unknown units {sorted(unknown)}: expected some of "
            f"{units} (the root is ''). Fix: use the names `build_plan` gives, or True/False"
        )
    return free_after


def shard(
    model: nn.Module,
    units: Units = None,
    strategy: str = "full",
    prefetch: bool = True,
    mixed_precision: MixedPrecision | None = None,
    mesh: Any = None,
    reshard_after_forward: bool | Iterable[str] | None = None,
    *,
    device: torch.device | str | None = None,
    param_init_fn: ParamInitFn | str | None = None,
    shard_init: SliceInit | None = None,
    sync_module_states: bool = False,
    use_orig_params: bool = True,
) -> nn.Module:
    """Shard `model` in place (FSDP/ZeRO) and return it.

    Args:
        model: identical on every rank (same init); parameters on one device.
        units: the wrap plan: module classes, module names, a policy callable, `MinParams`.
            Everything not claimed is the root unit. Ties must stay inside one unit.
        strategy: "none" (DDP), "optimizer" (ZeRO-1), "grad_op" (ZeRO-2), "full" (ZeRO-3);
            on a 2-D mesh "hybrid" (ZeRO-3 inside each shard group, HSDP) or "hybrid_zero2".
        prefetch: start the next unit's all-gather while the current one computes.
        mixed_precision: compute dtype and gradient-reduction dtype; None for fp32 throughout.
        mesh: None (all ranks), a 1-D DeviceMesh or a ProcessGroup spanning every rank; for
            the hybrid strategies (R, S) — R replicas of S-rank shard groups, R·S ranks — or a
            2-D (replicate, shard) DeviceMesh. See [Note: the 2-D mesh] in `sharding.mesh`.
        reshard_after_forward: "full"/"hybrid" only — which units are freed after forward and
            gathered again for backward. None or True (default): every unit but the root, as
            FSDP2 and FSDP1 do — the root's backward comes right after the forward, so freeing
            it would only buy one all-gather more per step; see [Note: the root stays
            gathered]. False: none. Or the unit names to free (the root's name, "", included).
        device: a meta model only: where its shards go (default: this rank's GPU under NCCL,
            else CPU).
        param_init_fn: a meta model only: called on every module, children before parents
            (default: its ``reset_parameters()``); see [Note: init order] in
            `fsdp_lab.sharding.materialize`. ``"empty"``: allocate the shards only (NaN), and
            initialise afterwards with ``with full_init(model): model.init_weights()``.
        shard_init: a meta model only: fills each rank's shard directly from a counter-based
            init (`fsdp_lab.meta_init.DeterministicInit`), without materialising any unit.
        sync_module_states: rank 0's values are broadcast to every rank before sharding (on a
            meta model, only rank 0 runs `param_init_fn`). Always on for "none", as DDP does.
        use_orig_params: True (default, FSDP2's behaviour): every parameter keeps its name, as
            this rank's slice of it (its full shape under "none"); frozen parameters stay
            frozen and a parameter without a gradient keeps ``grad=None``. False: one flat
            parameter per unit, ``flat_param`` (FSDP1's default; the sharding lab draws it).
            See [Note: per-parameter views] in `fsdp_lab.sharding.unit`.
    """
    check_model(model, strategy, dist.get_backend() if dist.is_initialized() else None)
    groups = meshes.resolve(mesh, strategy)  # every mesh error before any message
    world, rank = groups.world, groups.rank
    plan = build_plan(model, units)  # every plan error is raised here, before any collective
    on_meta = next(model.parameters()).is_meta  # one device: check_model made sure
    if not on_meta and (param_init_fn is not None or shard_init is not None):
        what = "param_init_fn" if param_init_fn is not None else "shard_init"
        raise ValueError(
            f"{what} initialises a model built on the meta device, but this model's parameters "
            f"are on {next(model.parameters()).device}. Fix: drop {what}, or build the model "
            "under torch.device('meta')"
        )
    if shard_init is not None and sync_module_states:
        raise ValueError(
            "shard_init and sync_module_states=True both make ranks agree; pick one "
            "(shard_init needs no communication)"
        )
    check_units(model, plan, use_orig_params)
    if strategy == "none" and shard_init is None:
        sync_module_states = True  # DDP: every replica starts from rank 0's values
    target = _target_device(device) if on_meta else None
    init_fn = param_init_fn or reset_parameters
    if on_meta and not recorded_ties(model):
        record_ties(model)  # identity ties are visible on meta: keep them for verification
    policy = ALL_SHARDING_STRATEGIES[strategy]
    free_after = _freed_after_forward(plan.units, policy, reshard_after_forward)

    state = ShardingState(groups=groups, prefetch=prefetch, strategy=strategy)
    sync_group = groups.sync_group
    lookup = dict(model.named_parameters(remove_duplicate=False))
    mp = mixed_precision
    built: dict[str, _Built] = {}

    def flat_of(name: str, params: list[torch.Tensor], values: SliceValues | None) -> FlatParameter:
        return FlatParameter(
            names=[r.name for r in plan.params[name]],
            params=params,
            shard_rank=rank if policy.sharded else 0,
            shard_size=world if policy.sharded else 1,
            compute_dtype=mp.param_dtype if mp else None,
            template=next(iter(lookup.values())),
            values=values,
            device=target,
            requires_grad=any(p.requires_grad for p in params),
        )

    def finish(name: str, flat: FlatParameter, frozen: list[bool]) -> _Built:
        refs = plan.params[name]
        if param_init_fn == EMPTY and flat.shard.is_floating_point():
            with torch.no_grad():  # uninitialised, loudly: a forgotten init_weights() shows
                flat.shard.fill_(float("nan"))
        owners = [[(model.get_submodule(m), attr) for m, attr in r.owners] for r in refs]
        aliases = [tuple(f"{m}.{a}" if m else a for m, a in r.owners) for r in refs]
        built[name] = _Built(flat, owners, aliases, _register_slices(flat, owners, frozen), frozen)
        return built[name]

    if on_meta and shard_init is None:  # parameter by parameter, in build order
        sink = _ShardSink(plan, model, lookup, flat_of, finish, sync_group, sync_module_states)
        try:
            with whole_init_functions():
                walk_build_order(model, plan, target, init_fn, sink, sync_group, sync_module_states)
        finally:
            remove_whole_views(sink.undo)
    else:
        for name in plan.units:
            refs = plan.params[name]
            params = [lookup[r.name] for r in refs]
            values = _slice_values(model, refs, shard_init, target, init_fn) if on_meta else None
            flat = flat_of(name, params, values)
            if sync_module_states and not on_meta:  # the whole unit in one message
                with torch.no_grad():
                    comm.broadcast(flat.shard.data, src=0, group=sync_group)
            finish(name, flat, [not p.requires_grad for p in params])
            del params
        if on_meta:
            materialize_buffers(model, target, init_fn, sync_group, sync_module_states)
        elif sync_module_states:
            with torch.no_grad():
                for b in model.buffers():
                    comm.broadcast(b, src=0, group=sync_group)
    for name in plan.units:  # root first: the order the hooks and `finalize_backward` expect
        b = built[name]
        modules = [model.get_submodule(m) for m in plan.members_of(name)]
        if not use_orig_params:
            for ref_owners in b.owners:
                for module, attr in ref_owners:
                    del module._parameters[attr]  # from now on a view, set by the unit
            modules[0].register_parameter(FLAT_PARAM, b.flat.shard)  # a group: its first member
        state.units.append(
            ShardedUnit(
                name=name,
                modules=modules,
                flat=b.flat,
                owners=b.owners,
                aliases=b.aliases,
                strategy=policy,
                state=state,
                reshard_after_forward=name in free_after,
                reduce_dtype=mp.reduce_dtype if mp else None,
                params=b.params if use_orig_params else None,
                frozen=b.frozen,
            )
        )
    attach_state(model, state)
    return model


class _ShardSink:
    """Takes a meta model's parameters one by one as the init walk finishes them: each goes
    straight into its unit's shard (this rank's slice), and a WholeView over that slice takes
    its place, so a later init (a tie's other owner, a parent) still sees it whole. Peak: the
    shards plus the parameters of the module being initialised."""

    def __init__(self, plan, model, lookup, flat_of, finish, group, sync) -> None:  # noqa: ANN001
        self.plan, self.model, self.lookup = plan, model, lookup
        self.flat_of, self.finish, self.group, self.sync = flat_of, finish, group, sync
        self.flats: dict[str, FlatParameter] = {}
        self.frozen: dict[str, list[bool]] = {}
        self.undo: list = []  # every WholeView installed, for remove_whole_views
        self.pending: dict[str, list[tuple[int, torch.Tensor]]] = {}  # under sync

    def begin(self, unit: str) -> None:
        metas = [self.lookup[r.name] for r in self.plan.params[unit]]
        self.frozen[unit] = [not p.requires_grad for p in metas]

        def later(name: str, shape: torch.Size, start: int, end: int) -> torch.Tensor:
            # Filled by `take`, parameter by parameter; a stride-0 zero allocates nothing.
            return torch.zeros(1).expand(end - start)

        self.flats[unit] = self.flat_of(unit, metas, later)

    def take(self, unit: str, index: int, param: torch.Tensor) -> torch.Tensor:
        if self.sync:  # only rank 0 inits: keep the unit whole until its end, then broadcast
            self.pending.setdefault(unit, []).append((index, param))
            return param
        return self._slice(unit, index, param)

    def _slice(self, unit: str, index: int, param: torch.Tensor) -> torch.Tensor:
        flat = self.flats[unit]
        segment = flat.segments[index]
        with torch.no_grad():
            if self.sync:
                comm.broadcast(param.data, src=0, group=self.group)
            a, b = flat.local_range(segment)
            s = flat.shard_rank * flat.shard_numel - segment.offset  # shard -> segment coords
            flat.shard[a:b] = param.detach().reshape(-1)[s + a : s + b]
        ref = self.plan.params[unit][index]
        owners = [(self.model.get_submodule(m), attr) for m, attr in ref.owners]
        refuse = "sync_module_states=True" if self.sync else None
        view = WholeView(flat.shard.detach()[a:b], segment.shape, s + a, s + b, ref.name)
        view.refuse = refuse
        for module, attr in owners:
            module._parameters[attr] = view  # type: ignore[assignment]
        return view

    def end(self, unit: str) -> None:
        for index, param in self.pending.pop(unit, []):
            self._slice(unit, index, param)
        built = self.finish(unit, self.flats.pop(unit), self.frozen.pop(unit))
        refuse = "sync_module_states=True" if self.sync else None
        self.undo.extend(install_whole_views([built], refuse))


@dataclass
class _Built:
    """One unit's storage, before its hooks: what `install_whole_views` and the unit need."""

    flat: FlatParameter
    owners: list[list[tuple[nn.Module, str]]]
    aliases: list[tuple[str, ...]]
    params: list[nn.Parameter]
    frozen: list[bool]


def _register_slices(
    flat: FlatParameter, owners: list[list[tuple[nn.Module, str]]], frozen: list[bool]
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
        for module, attr in ref_owners:  # tied: one Parameter under every name, as before
            module._parameters[attr] = param
        params.append(param)
    return params


def _slice_values(
    model: nn.Module,
    refs: tuple,
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
