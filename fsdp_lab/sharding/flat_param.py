"""Flat parameters: one unit's parameters as one padded 1-D buffer, cut into N equal shards.

This is FSDP1's `FlatParameter` (and DeepSpeed ZeRO-3's partitioned parameters) reduced to
its idea:

    params of the unit      w1 (4x3)   b1 (4)   w2 (2x4)        a tied one appears once
    flatten + concatenate   [ w1 ........ | b1 .. | w2 ...... | pad ]   padded to a multiple of N
    rank r keeps            shard r = flat[r*S : (r+1)*S]               S = padded / N

The shard is the only persistent storage (an `nn.Parameter`, so `model.parameters()` and any
`torch.optim` optimizer see it). Before the unit runs, the shards are all-gathered into the
*unsharded* buffer, and every original parameter becomes a view into it: `w1` is
``unsharded[0:12].view(4, 3)``. Freeing resizes that buffer's storage to 0 bytes — the views
stay valid Python objects (autograd saved some of them), and they come back to life when the
same storage is refilled for backward. FSDP1 and FSDP2 free exactly this way.

Where real FSDP goes further: FSDP2 keeps one DTensor per original parameter (sharded on
dim 0) instead of a flat buffer, so parameters keep their names and shapes, and copies them
in and out of a flat all-gather buffer; it also manages CUDA streams for the overlap.

The second half of this file builds each unit's storage from the model (`build_storage`,
step 4 of `shard()`): the flat shard, and the original parameters turned into slices of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from fsdp_lab import comm
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
from fsdp_lab.trace import category


@dataclass(frozen=True)
class Segment:
    """Where one original parameter lives in the flat buffer."""

    name: str  # first fully qualified name
    offset: int
    shape: torch.Size

    @property
    def numel(self) -> int:
        return self.shape.numel()


FILL_CHUNK = 1 << 20  # elements a slice initialiser is asked for at a time
SliceValues = Callable[[str, torch.Size, int, int], torch.Tensor]
"""(name, shape, start, end) -> elements [start, end) of that parameter, flattened (1-D)."""


class FlatParameter:
    """The flat, padded, sharded storage of one unit's parameters.

    Args:
        names: fully qualified names of the unit's parameters (a tied one once).
        params: the parameters, in the same order (their values are copied in). On the meta
            device they give shapes only, and `values` fills this rank's shard.
        shard_rank: this rank's index in the shard group.
        shard_size: ranks the buffer is split over (1 = replicated, as in DDP).
        compute_dtype: dtype of the unsharded buffer (bf16 for mixed precision).
        template: dtype and device to use when `params` is empty.
        values: for meta `params`: produces any slice of a parameter (a deterministic init).
        device: where the shard lives when `params` are on meta.
        requires_grad: whether any of the parameters trains (False: no gradient is built).
        offload: keep the shard in host memory (pinned when CUDA is there); the unsharded
            buffer stays on the compute device.
        compute_device: where the unsharded buffer lives (default: where the shard would).
    """

    def __init__(
        self,
        names: list[str],
        params: list[torch.Tensor],
        shard_rank: int,
        shard_size: int,
        compute_dtype: torch.dtype | None = None,
        template: torch.Tensor | None = None,
        values: SliceValues | None = None,
        device: torch.device | None = None,
        requires_grad: bool = True,
        offload: bool = False,
        compute_device: torch.device | None = None,
    ) -> None:
        # A root unit can be left with no parameters: `template` then gives dtype and device.
        like = params[0] if params else template
        if like is None:
            raise ValueError("a FlatParameter without parameters needs a template tensor")
        dtype = like.dtype
        device = device if device is not None and like.is_meta else like.device
        if device.type == "meta":
            raise ValueError("a FlatParameter from meta parameters needs a real `device`")
        if values is None:
            if any(p.is_meta for p in params):
                raise ValueError(
                    "meta parameters have no values: pass `values` (a slice initialiser)"
                )
            by_name = dict(zip(names, params, strict=True))

            def values(name: str, shape: torch.Size, start: int, end: int) -> torch.Tensor:
                return by_name[name].detach().reshape(-1)[start:end]

        self.segments: list[Segment] = []
        offset = 0
        for name, p in zip(names, params, strict=True):
            self.segments.append(Segment(name, offset, p.shape))
            offset += p.numel()
        self.numel = offset  # real elements
        self.shard_rank, self.shard_size = shard_rank, shard_size
        self.padded_numel = -(-self.numel // shard_size) * shard_size  # ceil to a multiple of N
        self.shard_numel = self.padded_numel // shard_size
        self.compute_dtype = compute_dtype or dtype
        self.device = compute_device or device  # where the unit computes
        self.offload = offload
        host = torch.device("cpu")

        with torch.no_grad(), category("parameters"):
            # The rank's persistent shard, in the parameters' own dtype (fp32 master copy),
            # filled slice by slice: no full-size flat copy of the unit is ever made.
            shard = torch.zeros(self.shard_numel, dtype=dtype, device=host if offload else device)
            if offload and torch.cuda.is_available():
                shard = shard.pin_memory()  # copies to and from the GPU can then overlap
            self._fill(shard, values)
            self.shard = nn.Parameter(shard, requires_grad=requires_grad)

        # Replicated, not cast, not offloaded: the parameter itself is the unsharded buffer (DDP).
        self.aliased = shard_size == 1 and self.compute_dtype == dtype and not offload
        self.split_node: torch.autograd.graph.Node | None = None  # set by `views()`
        self._views: list[torch.Tensor] | None = None  # the last ones made (`views()`)
        if self.aliased:
            self.unsharded: torch.Tensor = self.shard
        else:
            with category("comm_buffers"):
                # Shape (padded,) over a one-element storage (stride 0): a full-size empty
                # buffer here would count a whole unit for a moment, on top of the parameters
                # it is built from. `alloc_unsharded` gives it real, contiguous storage.
                self.unsharded = torch.empty_strided(
                    (self.padded_numel,),
                    (0,),
                    dtype=self.compute_dtype,
                    device=self.device,
                    requires_grad=requires_grad,
                )
            self.free_unsharded()

    # -- the unsharded buffer's storage: allocated for use, resized to 0 to free ---------------

    @property
    def is_allocated(self) -> bool:
        return self.unsharded.untyped_storage().nbytes() > 0

    def alloc_unsharded(self) -> None:
        storage = self.unsharded.untyped_storage()
        size = self.padded_numel * self.unsharded.element_size()
        if self.unsharded.stride() == (0,):  # first use: contiguous from now on
            with torch.no_grad():
                self.unsharded.set_(storage, 0, (self.padded_numel,), (1,))
        if storage.nbytes() != size:
            storage.resize_(size)

    def free_unsharded(self) -> None:
        if not self.aliased:
            self.unsharded.untyped_storage().resize_(0)

    # -- views ---------------------------------------------------------------------------------

    def views(self, fresh: bool = True) -> list[torch.Tensor]:
        """The original parameters as views into the unsharded buffer (autograd flows back).

        `fresh=False`: the views made last, if they can serve — backward sets again the views
        its forward made (no operator), unless they were made without the autograd it wants
        now. A forward makes new ones: autograd runs ready nodes newest first, so a split kept
        from an earlier step would build its gradient only after the whole backward."""
        if not self.segments:
            return []
        wants_grad = torch.is_grad_enabled() and self.unsharded.requires_grad
        usable = self.split_node is not None or not wants_grad
        if not fresh and usable and self._views is not None:
            return self._views
        # One split, not a slice per parameter: autograd then builds the unit's gradient with
        # a single cat (SplitWithSizesBackward) instead of a zero-filled full-size buffer per
        # parameter (SliceBackward) summed into the accumulator — as FSDP1 does.
        sizes = [s.numel for s in self.segments]
        parts = torch.split(self.unsharded, sizes + [self.padding] if self.padding else sizes)
        self.split_node = parts[0].grad_fn  # builds the unit's gradient (None: no autograd)
        self._views = [part.view(s.shape) for part, s in zip(parts, self.segments, strict=False)]
        return self._views

    def _fill(self, shard: torch.Tensor, values: SliceValues) -> None:
        """Copy into `shard` the part of each parameter that falls in this rank's range."""
        start = self.shard_rank * self.shard_numel
        stop = start + self.shard_numel
        for seg in self.segments:
            lo, hi = max(seg.offset, start), min(seg.offset + seg.numel, stop)
            # This segment's overlap with the shard, [lo, hi) in flat coordinates, in chunks:
            # an initialiser's temporaries then stay small however large the shard is.
            for a in range(lo, hi, FILL_CHUNK):
                b = min(a + FILL_CHUNK, hi)
                piece = values(seg.name, seg.shape, a - seg.offset, b - seg.offset)
                if piece.shape != (b - a,):
                    raise ValueError(
                        f"the initialiser returned shape {tuple(piece.shape)} for elements "
                        f"[{a - seg.offset}, {b - seg.offset}) of {seg.name!r}; expected "
                        f"({b - a},)"
                    )
                shard[a - start : b - start].copy_(piece)

    def local_range(self, segment: Segment) -> tuple[int, int]:
        """Where `segment`'s elements on this rank sit in the shard: [a, b), maybe empty."""
        start = self.shard_rank * self.shard_numel
        a = min(max(segment.offset - start, 0), self.shard_numel)
        b = min(max(segment.offset + segment.numel - start, 0), self.shard_numel)
        return a, b

    def pieces(self, shard_like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A shard-sized tensor cut into each segment's part on this rank, then the padding:
        one split (one operator), 1-D parts (maybe empty)."""
        local = [b - a for a, b in map(self.local_range, self.segments)]
        return shard_like.split([*local, self.shard_numel - sum(local)])

    def slice_lengths(self, segment: Segment) -> list[int]:
        """How many of `segment`'s elements each rank of the shard group holds."""
        return [
            max(
                0,
                min(segment.offset + segment.numel, (r + 1) * self.shard_numel)
                - max(segment.offset, r * self.shard_numel),
            )
            for r in range(self.shard_size)
        ]

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a full (unpadded or padded) flat tensor into named, shaped tensors."""
        return {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.segments}

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of `unflatten`: a padded flat tensor from named full tensors."""
        flat = torch.zeros(self.padded_numel, dtype=self.shard.dtype, device=self.shard.device)
        for s in self.segments:
            flat[s.offset : s.offset + s.numel].copy_(tensors[s.name].reshape(-1))
        return flat

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a padded flat tensor."""
        start = self.shard_rank * self.shard_numel
        return flat[start : start + self.shard_numel]

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel


# --------------------------------------------------------------------------------------------
# Each unit's storage: its `FlatParameter` (this rank's shard) and the original parameters
# turned into slices of it — step 4 of `shard()`.
#
#     model with values        for each unit: flatten its parameters, keep shard r (and, under
#                              sync_module_states, rank 0's values broadcast first)
#     model on meta            ordinary init module by module, each parameter into its shard as
#                              soon as it is made (`materialize.shard_in_build_order`), or every
#                              shard generated directly from a counter-based init (`shard_init`)
#
# Afterwards each original parameter is this rank's slice of it, a view into the flat shard
# registered in its own slot (same name, same place in `named_parameters()`).


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
