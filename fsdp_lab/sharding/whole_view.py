"""A sharded parameter seen whole, so that a model's own init code runs on its shards.

torchtitan builds on meta, shards, allocates only the shards, and then calls the model's own
``init_weights()`` on the sharded model: the init code reads ``p.shape``/``p.dim()`` and calls
``nn.init.trunc_normal_(p, std=...)``, ``p.normal_()``, ``p.fill_(1.0)``. On this package's
shards (a 1-D slice of each parameter) that code would see the wrong shape, and each rank
would draw its own random numbers — the model would train from a different init.

    with full_init(model):       every sharded parameter slot holds a WholeView:
        model.init_weights()        shape, dtype, device of the whole parameter
                                    storage: only this rank's slice
                                    random op (normal_, uniform_, ...): draw the whole
                                      parameter (the RNG advances exactly as in one process),
                                      keep this rank's slice
                                    in-place element-wise op (fill_, mul_, clamp_, erfinv_,
                                      copy_ from a whole tensor): applied to the slice
                                    an `nn.init` function (trunc_normal_, kaiming_uniform_,
                                      orthogonal_, ...): run on the whole parameter, keep
                                      the slice

So each rank holds its slice of exactly what one process running the same code would hold,
bitwise, at the cost of one whole parameter at a time. Anything else — reading values
(``p.sum()``), indexing (``p[0]``) — is refused with a clear error.
FSDP2 gets the same effect from DTensor: its random ops offset the Philox counter per shard
(`torch.distributed.tensor._random`); this is the CPU-friendly, one-process-equivalent cousin.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

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
