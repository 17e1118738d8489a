"""Materialising a meta-device model piece by piece, so no rank holds the whole model.

(Over 450 lines on purpose: materialising a meta model and the whole view its own init code sees
are one story, read in the order `shard()` runs them; the walk installs a view at every module.)

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
sees it whole (`WholeView`, below): a random op or an `nn.init` function runs on the
whole parameter and each rank keeps its slice, so the values are bitwise those of one process
running the same code (the cost: that one parameter whole, for a moment). Under
``sync_module_states`` only rank 0 runs the init, so a unit stays whole until the walk has
left it, then is broadcast; a later init reaching into it is refused there. `materialize()` walks the same order without sharding:
the reference the sharded result must equal.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from fsdp_lab import comm
from fsdp_lab.sharding.wrap import ParamRef, Units, WrapPlan, build_plan, unit_of_module

# --------------------------------------------------------------------------------------------
# A sharded parameter seen whole, so that a model's own init code runs on its shards.
#
# torchtitan builds on meta, shards, allocates only the shards, and then calls the model's own
# ``init_weights()`` on the sharded model: the init code reads ``p.shape``/``p.dim()`` and calls
# ``nn.init.trunc_normal_(p, std=...)``, ``p.normal_()``, ``p.fill_(1.0)``. On this package's
# shards (a 1-D slice of each parameter) that code would see the wrong shape, and each rank
# would draw its own random numbers — the model would train from a different init.
#
#     with full_init(model):       every sharded parameter slot holds a WholeView:
#         model.init_weights()        shape, dtype, device of the whole parameter
#                                     storage: only this rank's slice
#                                     random op (normal_, uniform_, ...): draw the whole
#                                       parameter (the RNG advances exactly as in one process),
#                                       keep this rank's slice
#                                     in-place element-wise op (fill_, mul_, clamp_, erfinv_,
#                                       copy_ from a whole tensor): applied to the slice
#                                     an `nn.init` function (trunc_normal_, kaiming_uniform_,
#                                       orthogonal_, ...): run on the whole parameter, keep
#                                       the slice
#
# So each rank holds its slice of exactly what one process running the same code would hold,
# bitwise, at the cost of one whole parameter at a time. Anything else — reading values
# (``p.sum()``), indexing (``p[0]``) — is refused with a clear error.
# FSDP2 gets the same effect from DTensor: its random ops offset the Philox counter per shard
# (`torch.distributed.tensor._random`); this is the CPU-friendly, one-process-equivalent cousin.


aten = torch.ops.aten
# In-place random fills: drawn for the whole parameter, so every rank's generator advances as
# one process's would, and each keeps its own slice.
_RANDOM = {
    aten.normal_,
    aten.uniform_,
    aten.bernoulli_,
    aten.random_,
    aten.exponential_,
    aten.log_normal_,
    aten.cauchy_,
    aten.geometric_,
}
_ALIASES = {aten.detach, aten.alias}  # `with torch.no_grad()`, `.data`: the same view


class WholeView(torch.Tensor):
    """The whole parameter's metadata over this rank's slice [lo, hi) of it (flattened)."""

    local: torch.Tensor
    lo: int
    hi: int
    param_name: str
    refuse: str | None
    # Python-level functions (nn.init.*) run as written; only the aten ops below are ours.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local: torch.Tensor, shape: torch.Size, lo: int, hi: int, name: str):
        view = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=local.dtype, device=local.device, requires_grad=False
        )
        view.local, view.lo, view.hi, view.param_name = local, lo, hi, name
        view.refuse = None
        return view

    def __repr__(self) -> str:  # values are not all here: never print them
        return f"WholeView({self.param_name!r}, shape={tuple(self.shape)}, slice=[{self.lo}, {self.hi}))"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        packet = func.overloadpacket
        if isinstance(target, WholeView):
            _check_allowed(target)
        if packet in _ALIASES and isinstance(target, WholeView):
            return target
        if not isinstance(target, WholeView) or not packet.__name__.endswith("_"):
            names = [a.param_name for a in args if isinstance(a, WholeView)]
            raise TypeError(
                f"init code ran {packet.__name__} on the sharded parameter {names[0]!r}, seen "
                "whole under fsdp_lab.sharding.full_init: only torch.nn.init functions and "
                "in-place element-wise and random ops (normal_, fill_, zero_, mul_, copy_ from a "
                "whole tensor, ...) can run on a rank's slice. Fix: initialise that module with "
                "param_init_fn= in shard() (each unit is materialised whole there)"
            )
        if packet in _RANDOM:
            whole = torch.empty(target.shape, dtype=target.dtype, device=target.device)
            func(whole, *args[1:], **kwargs)
            target.local.copy_(whole.reshape(-1)[target.lo : target.hi])
            return target

        def local(a: Any) -> Any:
            if isinstance(a, WholeView):
                return a.local
            if isinstance(a, torch.Tensor) and a.dim() > 0:
                if a.shape != target.shape:
                    raise TypeError(
                        f"{packet.__name__} on {target.param_name!r} (shape {tuple(target.shape)}) "
                        f"with a tensor of shape {tuple(a.shape)}: under full_init an operand "
                        "must be a scalar or have the parameter's whole shape"
                    )
                return a.reshape(-1)[target.lo : target.hi]
            return a

        func(target.local, *tree_map(local, args[1:]), **tree_map(local, kwargs))
        return target


def _run_whole(init: Callable[..., Any]) -> Callable[..., Any]:
    """`init` (an `nn.init` function) on a WholeView: run it on the whole parameter, keep the
    slice. Covers what element-wise ops cannot: rejection sampling (`trunc_normal_` draws
    until accepted), fans from the shape, QR (`orthogonal_`)."""

    @functools.wraps(init)
    def run(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not isinstance(tensor, WholeView):
            return init(tensor, *args, **kwargs)
        _check_allowed(tensor)
        whole = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        init(whole, *args, **kwargs)
        tensor.local.copy_(whole.reshape(-1)[tensor.lo : tensor.hi])
        return tensor

    return run


@contextmanager
def whole_init_functions() -> Iterator[None]:
    """While inside, every in-place `torch.nn.init` function runs whole on a WholeView."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    originals = {n: getattr(nn.init, n) for n in names}
    for n, f in originals.items():
        setattr(nn.init, n, _run_whole(f))
    try:
        yield
    finally:
        for n, f in originals.items():
            setattr(nn.init, n, f)


def _check_allowed(view: WholeView) -> None:
    if view.refuse is not None:
        raise ValueError(
            f"an init reached into {view.param_name!r} after its unit was sharded, with "
            f"{view.refuse}: only rank 0 runs the init there, so the other ranks' slices "
            "would not change. Fix: drop sync_module_states (every rank runs the same init "
            "with the same seed), or put that module in the same unit as its parent"
        )


def install_whole_views(units: list[Any], refuse: str | None = None) -> list[tuple]:
    """Put a WholeView in every parameter slot of `units` (ShardedUnits, or units being built:
    anything with `flat`, `owners`, `aliases`); returns what `remove_whole_views` puts back.
    `refuse`: a reason any op on them is an error (a parent's init reaching into a sharded unit
    under sync_module_states: only rank 0 runs it, so the other ranks' slices would differ)."""
    undo = []
    for unit in units:
        flat = unit.flat
        shard = flat.shard.detach()
        for i, (segment, owners) in enumerate(zip(flat.segments, unit.owners, strict=True)):
            a, b = flat.local_range(segment)
            start = flat.shard_rank * flat.shard_numel - segment.offset
            view = WholeView(shard[a:b], segment.shape, start + a, start + b, unit.aliases[i][0])
            view.refuse = refuse
            for module, attr in owners:  # tied: one WholeView under every name
                undo.append((module, attr, module._parameters.get(attr)))
                module._parameters[attr] = view  # type: ignore[assignment]
    return undo


def remove_whole_views(undo: list[tuple[nn.Module, str, Any]]) -> None:
    for module, attr, before in reversed(undo):
        if before is None:
            del module._parameters[attr]
        else:
            module._parameters[attr] = before


@contextmanager
def full_init(model: nn.Module) -> Iterator[None]:
    """Run init code on a sharded model as if it were whole (see the module docstring).

    Example (torchtitan's pattern)::

        with torch.device("meta"):
            model = Transformer(config)
        shard(model, units={TransformerBlock}, param_init_fn="empty")
        with full_init(model):
            model.init_weights()
    """
    from fsdp_lab.sharding.state import sharding_state

    state = sharding_state(model)
    undo = install_whole_views(state.units)
    try:
        with torch.no_grad(), whole_init_functions():
            yield
    finally:
        remove_whole_views(undo)
    for unit in state.units:
        unit.stale = True  # the shards changed: gather again


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
    """What `shard_in_build_order` needs to make a unit's storage (`flat_param.StorageBuilder`,
    which builds on this file: its `FlatParameter`s are `Any` here, so no import runs back)."""

    def flat_of(
        self, unit: str, params: list[torch.Tensor], values: Callable[..., torch.Tensor] | None
    ) -> Any: ...

    def finish(self, unit: str, flat: Any, frozen: list[bool]) -> Any: ...


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
        self.flats: dict[str, Any] = {}  # unit -> its FlatParameter
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
