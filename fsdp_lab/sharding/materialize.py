"""Materialising a meta-device model piece by piece, so no rank holds the whole model.

A model built under ``torch.device("meta")`` has shapes and no storage: a 70-billion-parameter
model costs nothing. `shard` then turns it into real shards in one of two ways:

    ordinary init (FSDP1's ``param_init_fn``)       deterministic slices (`SliceInit`)
    for each module, in build order:                for each unit:
        to_empty it (a tie: one new tensor)             allocate this rank's shard only
        param_init_fn(module)                           fill it with values(name, shape, a, b)
        each parameter it made real:                    (each element a pure function of
            copy this rank's slice into its              seed, name and index: no collective)
            unit's shard, drop the full tensor
    peak: the shards + one module's parameters      peak: the shards
          (at most the largest unit)

Ordinary init draws from one sequential random stream (`torch.manual_seed`), so a value depends
on everything drawn before it: ranks agree only if each initialises the *whole* unit in the same
order — or rank 0 does and broadcasts (``sync_module_states``). A counter-based scheme gives any
slice directly; see `fsdp_lab.meta_init.counter_init`.

Buffers (a rotary cache, BatchNorm statistics) are not sharded: each rank materialises them and
runs ``param_init_fn`` on their module (rank 0's values are broadcast under ``sync``).

[Note: init order] ``param_init_fn`` is called on *every* module, parents included (FSDP1 calls
it on each module it materialises), children before their parent — the order in which an
ordinary build finishes constructing them, so a parent's own init (GPT-2 scales its residual
projections from the block; a root re-initialises everything) runs last and wins, as it does
in an ordinary build. A parameter goes into its unit's shard right after the init of the
module that made it real. A later init that reaches into it — a tie's other owner, a parent —
sees it whole (`whole_view.WholeView`): a random op or an `nn.init` function runs on the
whole parameter and each rank keeps its slice, so the values are bitwise those of one process
running the same code (the cost: that one parameter whole, for a moment). Under
``sync_module_states`` only rank 0 runs the init, so a unit stays whole until the walk has
left it, then is broadcast; a later init reaching into it is refused there. `materialize()` walks the same order without sharding:
the reference the sharded result must equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn as nn

from fsdp_lab import comm
from fsdp_lab.sharding.flat_param import FlatParameter, SliceValues
from fsdp_lab.sharding.whole_view import (
    WholeView,
    install_whole_views,
    remove_whole_views,
    whole_init_functions,
)
from fsdp_lab.sharding.wrap import ParamRef, Units, WrapPlan, build_plan, unit_of_module

ParamInitFn = Callable[[nn.Module], None]
EMPTY = "empty"  # param_init_fn="empty": allocate only, init later (torchtitan's to_empty)


class SliceInit(Protocol):
    """Anything that produces any slice of any parameter, e.g. `meta_init.DeterministicInit`."""

    def values(
        self,
        name: str,
        shape: tuple[int, ...],
        start: int,
        end: int,
        dtype: torch.dtype = ...,
        device: torch.device | str = ...,
    ) -> torch.Tensor: ...


def reset_parameters(module: nn.Module) -> None:
    """The default ``param_init_fn``: the module's own ``reset_parameters()``.

    A module without one is fine if it owns no tensor itself (a container, a block); one that
    owns parameters or buffers directly and has no ``reset_parameters()`` is an error.
    """
    reset = getattr(module, "reset_parameters", None)
    if reset is None:
        own = [n for n, _ in module.named_parameters(recurse=False)]
        own += [n for n, _ in module.named_buffers(recurse=False)]
        if not own:
            return
        raise ValueError(
            f"{type(module).__name__} has no reset_parameters() to initialise {own} after "
            "materialising from meta. Fix: pass param_init_fn=<function of the module> to shard()"
        )
    reset()


def owning_modules(model: nn.Module, refs: tuple[ParamRef, ...]) -> list[tuple[str, nn.Module]]:
    """The modules that own the unit's parameters (both owners of a tie), in module order."""
    names = {m for ref in refs for m, _ in ref.owners}
    return [(n, m) for n, m in model.named_modules() if n in names]


def to_empty_keeping_ties(modules: list[nn.Module], device: torch.device) -> None:
    """`Module.to_empty(recurse=False)` for each module, one new tensor per meta tensor.

    `to_empty` puts a new Parameter into each owner's slot, so a tied Parameter would become
    two — and, for a moment, take twice its memory. Here every owner of one meta Parameter
    gets the very same new one.
    """
    made: dict[int, torch.Tensor] = {}
    for module in modules:
        _to_empty(module, device, made)


def post_order(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """Every module, children before their parent (siblings in registration order)."""
    out = []
    for name, child in module.named_children():
        out += post_order(child, f"{prefix}.{name}" if prefix else name)
    return out + [(prefix, module)]


class UnitSink(Protocol):
    """Where `walk_build_order` hands each unit's parameters as they become ready (`shard`)."""

    def begin(self, unit: str) -> None: ...

    def take(self, unit: str, index: int, param: torch.Tensor) -> torch.Tensor: ...

    def end(self, unit: str) -> None: ...


def walk_build_order(
    model: nn.Module,
    plan: WrapPlan,
    device: torch.device,
    param_init_fn: ParamInitFn | str,
    sink: UnitSink | None = None,
    group: object | None = None,
    sync: bool = False,
) -> None:
    """Materialise and initialise `model` module by module in build order ([Note: init order]).

    A parameter is handed to `sink.take` right after the init of the module that made it real;
    whatever `take` returns (a WholeView over its slice) takes its place in every owner's slot,
    so only the parameters of the module being initialised are ever whole. Without a sink (the
    single-process reference) the parameters stay where they are.
    """
    order = post_order(model)
    metas = dict(model.named_parameters())  # kept alive: their ids key `made`
    name_of = {id(p): n for n, p in metas.items()}
    index_in_unit = {r.name: (u, j) for u in plan.units for j, r in enumerate(plan.params[u])}
    roots = [plan.members_of(u) for u in plan.units]
    unit_of = {name: unit_of_module(name, roots) for name, _ in order}
    last = {unit_of[name]: i for i, (name, _) in enumerate(order)}
    is_src = not sync or torch.distributed.get_rank() == 0
    made: dict[int, torch.Tensor] = {}  # meta tensor -> what replaced it (one, for a tie)
    started: set[str] = set()
    for i, (name, module) in enumerate(order):
        unit = unit_of[name]
        if unit not in started:
            started.add(unit)
            if sink is not None:
                sink.begin(unit)
        fresh = _to_empty(module, device, made)
        if is_src and param_init_fn != EMPTY:
            param_init_fn(module)  # type: ignore[operator]
        for meta_id in fresh:
            full = name_of[meta_id]
            param = model.get_parameter(full)
            _check_initialised(full, param, device)
            _check_shape(full, param, metas[full].shape)
            if sink is not None:
                owner_unit, j = index_in_unit[full]
                made[meta_id] = sink.take(owner_unit, j, param)
        if i == last[unit] and sink is not None:
            sink.end(unit)
    for name, module in model.named_modules():
        for b, tensor in module.named_buffers(recurse=False):
            if tensor.is_meta:
                full = f"{name}.{b}" if name else b
                raise ValueError(
                    f"param_init_fn left buffer {full!r} on the meta device: it must fill the "
                    "buffer (e.g. recompute a rotary cache in reset_parameters())"
                )
            if sync:
                comm.broadcast(tensor, src=0, group=group)


def _to_empty(module: nn.Module, device: torch.device, made: dict[int, torch.Tensor]) -> list[int]:
    """`to_empty(recurse=False)`, tie-aware across calls: a tied Parameter already made (or
    already sharded) for its first owner is reused. Returns the meta parameters made now."""
    fresh = []
    for slots, is_param in ((module._parameters, True), (module._buffers, False)):
        for key, t in slots.items():
            if t is None or not t.is_meta:
                continue
            if id(t) not in made:
                new = torch.empty_like(t, device=device)
                made[id(t)] = nn.Parameter(new, t.requires_grad) if is_param else new
                if is_param:
                    fresh.append(id(t))
            slots[key] = made[id(t)]
    return fresh


def materialize_buffers(
    model: nn.Module,
    device: torch.device,
    param_init_fn: ParamInitFn,
    group: object | None = None,
    sync: bool = False,
) -> list[str]:
    """Materialise and initialise every module whose buffers are still on meta; their names.

    Runs after the units: these modules own buffers only (a module with parameters got its
    buffers with its unit), so `param_init_fn` cannot touch a sharded parameter.
    """
    done = []
    is_src = not sync or torch.distributed.get_rank() == 0
    for name, module in model.named_modules():
        meta = [b for b, t in module.named_buffers(recurse=False) if t.is_meta]
        if not meta:
            continue
        for b in meta:  # by hand: to_empty would also overwrite the unit's real shard
            module._buffers[b] = torch.empty_like(module._buffers[b], device=device)
        if is_src:
            param_init_fn(module)
        for b in meta:
            tensor = module._buffers[b]
            full = f"{name}.{b}" if name else b
            if tensor is None or tensor.is_meta:
                raise ValueError(
                    f"param_init_fn left buffer {full!r} on the meta device: it must fill the "
                    "buffer (e.g. recompute a rotary cache in reset_parameters())"
                )
            if sync:
                comm.broadcast(tensor, src=0, group=group)
            done.append(full)
    return done


def concrete_device(device: torch.device | str) -> torch.device:
    """The device a tensor made on `device` reports: "cuda" -> "cuda:<current>", "cpu:0" -> "cpu".

    Parameters are compared with it after `param_init_fn`; "cuda" != "cuda:0" as devices.
    """
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("device='meta': shards need real memory. Fix: device='cpu' or 'cuda'")
    return torch.empty(0, device=device).device


def _check_shape(name: str, p: torch.Tensor, shape: torch.Size) -> None:
    if p.shape != shape:
        raise ValueError(
            f"param_init_fn changed the shape of {name!r} from {tuple(shape)} to "
            f"{tuple(p.shape)}: initialise in place, keeping the shape built on meta"
        )


def _check_initialised(name: str, p: torch.Tensor, device: torch.device) -> None:
    if p.is_meta:
        raise ValueError(
            f"param_init_fn left parameter {name!r} on the meta device: it must fill the "
            "materialised parameter in place (nn.init.*_ or reset_parameters), not replace it"
        )
    if p.device != device:
        raise ValueError(
            f"parameter {name!r} is on {p.device} after param_init_fn, expected {device}"
        )


def materialize(
    model: nn.Module,
    units: Units = None,
    device: torch.device | str = "cpu",
    param_init_fn: ParamInitFn | str = reset_parameters,
) -> nn.Module:
    """Single process, no sharding: materialise and initialise `model` in place, in the very
    order `shard(model, units, param_init_fn=...)` does ([Note: init order]) — the reference
    its sharded result must equal bitwise. ``param_init_fn="empty"``: allocate only.
    """
    if not any(p.is_meta for p in model.parameters()):
        raise ValueError("materialize() takes a model built on meta; this one has values")
    walk_build_order(model, build_plan(model, units), concrete_device(device), param_init_fn)
    return model


# -- the meta path of `shard`: each parameter into its unit's shard as soon as it is made -------


class UnitStorageBuilder(Protocol):
    """What `shard_in_build_order` needs to make a unit's storage (`storage.StorageBuilder`)."""

    def flat_of(
        self, unit: str, params: list[torch.Tensor], values: SliceValues | None
    ) -> FlatParameter: ...

    def finish(self, unit: str, flat: FlatParameter, frozen: list[bool]) -> Any: ...


def shard_in_build_order(
    model: nn.Module,
    plan: WrapPlan,
    builder: UnitStorageBuilder,
    device: torch.device,
    init_fn: ParamInitFn | str,
    group: object | None,
    sync: bool,
) -> None:
    """Materialise a meta `model` straight into its units' shards ([Note: init order]): the
    walk hands each parameter over as soon as its module's init made it real."""
    sink = _ShardSink(plan, model, builder, group, sync)
    try:
        with whole_init_functions():
            walk_build_order(model, plan, device, init_fn, sink, group, sync)
    finally:
        remove_whole_views(sink.undo)


class _ShardSink:
    """Takes a meta model's parameters one by one as the init walk finishes them: each goes
    straight into its unit's shard (this rank's slice), and a WholeView over that slice takes
    its place, so a later init (a tie's other owner, a parent) still sees it whole. Peak: the
    shards plus the parameters of the module being initialised."""

    def __init__(
        self,
        plan: WrapPlan,
        model: nn.Module,
        builder: UnitStorageBuilder,
        group: object | None,
        sync: bool,
    ) -> None:
        self.plan, self.model, self.builder, self.group, self.sync = (
            plan,
            model,
            builder,
            group,
            sync,
        )
        self.metas = dict(model.named_parameters(remove_duplicate=False))
        self.flats: dict[str, FlatParameter] = {}
        self.frozen: dict[str, list[bool]] = {}
        self.undo: list = []  # every WholeView installed, for remove_whole_views
        self.pending: dict[str, list[tuple[int, torch.Tensor]]] = {}  # under sync
        # Under sync only rank 0 inits: a later init reaching into a unit would change rank 0's
        # slice alone, so it is refused.
        self.refuse = "sync_module_states=True" if sync else None

    def begin(self, unit: str) -> None:
        metas = [self.metas[r.name] for r in self.plan.params[unit]]
        self.frozen[unit] = [not p.requires_grad for p in metas]

        def later(name: str, shape: torch.Size, start: int, end: int) -> torch.Tensor:
            # Filled by `take`, parameter by parameter; a stride-0 zero allocates nothing.
            return torch.zeros(1).expand(end - start)

        self.flats[unit] = self.builder.flat_of(unit, metas, later)

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
        view = WholeView(flat.shard.detach()[a:b], segment.shape, s + a, s + b, ref.name)
        view.refuse = self.refuse
        for m, attr in ref.owners:
            self.model.get_submodule(m)._parameters[attr] = view  # type: ignore[assignment]
        return view

    def end(self, unit: str) -> None:
        for index, param in self.pending.pop(unit, []):
            self._slice(unit, index, param)
        built = self.builder.finish(unit, self.flats.pop(unit), self.frozen.pop(unit))
        self.undo.extend(install_whole_views([built], self.refuse))
