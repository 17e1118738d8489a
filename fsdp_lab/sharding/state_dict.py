"""Checkpoints of a sharded model (full or sharded), and gradient clipping across shards.

Between steps no rank holds a full parameter, so a checkpoint picks one of two layouts: FSDP1's
`FULL_STATE_DICT` / `SHARDED_STATE_DICT`, the two ways of `torch.distributed.checkpoint` (DCP).

    full     full_state_dict       all-gather each unit, unflatten: exactly `model.state_dict()`
                                   of the unsharded model, on rank 0. Loads anywhere (any world
                                   size, no fsdp_lab), but one rank holds the whole model.
             load_full_state_dict  rank 0 checks it and broadcasts each unit's flat buffer;
                                   every rank keeps its own slice (`shard_of`)
    sharded  save_sharded          every rank writes only its shards and optimizer state, in
                                   parallel, into a new version folder; then rank 0 switches
                                   meta.json to it (crash-safe, see the Note below)
             load_sharded          every rank reads its own file and checks it against meta.json
                                   (size, sha256, rank): no data moves, but only into the same
                                   world size and wrap plan

The sharded layout, crash-safe, is `sharded_checkpoint.py`.

`clip_grad_norm_` lives here too: like a checkpoint, it needs a global view (the norm of the
whole gradient) of something each rank holds only a slice of.

Where real FSDP goes further: DCP stores every parameter's shards with their offsets, so a
sharded checkpoint can be *resharded* on load to another world size, and it can write
asynchronously (its `.metadata` file is, like our meta.json, written last); FSDP2's
`get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))`
is our `full_state_dict`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab import comm
from fsdp_lab.sharding.state import ShardingState, sharding_state

# -- full state dict ----------------------------------------------------------------------------


def full_state_dict(model: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter by original name (both names of a tied one) and buffer, full, on CPU.

    Args:
        model: a model sharded by `fsdp_lab.shard`.
        rank0_only: other ranks return {} (they still take part in every all-gather).
    """
    state = sharding_state(model)
    keep = state.shard_rank == 0 or not rank0_only
    out: dict[str, torch.Tensor] = {}
    for unit in state.units:
        flat = unit.flat
        if flat.padded_numel == 0:  # a root unit left with no parameters
            continue
        # Not `unit.unshard()`: that gathers in the compute dtype (bf16 under mixed precision)
        # into the live buffer; a checkpoint wants the fp32 shards and leaves training alone.
        full = flat.shard.detach()  # replicated ("none"): the shard is the whole buffer
        if flat.shard_size > 1:  # gathered where the unit computes (offload: not the host)
            full = torch.empty(flat.padded_numel, dtype=full.dtype, device=flat.device)
            comm.all_gather_into_tensor(
                full, flat.shard.detach().to(flat.device), group=state.group
            )
        if keep:
            for view, names in zip(flat.unflatten(full).values(), unit.aliases, strict=True):
                # One copy shared by all names of a tied parameter: torch.save writes it once
                # and torch.load gives back one tensor under both names.
                out.update(dict.fromkeys(names, view.to("cpu", copy=True)))
    if not keep:
        return {}
    copies: dict[int, torch.Tensor] = {}
    for name, buf in [*ignored_params(model, state), *persistent_buffers(model)]:
        out[name] = copies.setdefault(id(buf), buf.detach().to("cpu", copy=True))
    # model.state_dict()'s order, module by module (the sort is stable: params, then buffers).
    order = {name: i for i, (name, _) in enumerate(model.named_modules(remove_duplicate=False))}
    # Names are those at shard() time; a module wrapped since (checkpointing) sorts last.
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0].rpartition(".")[0], len(order))))


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor] | None) -> None:
    """Load a full state dict held by rank 0 into every rank's shards (and buffers).

    Args:
        model: a model sharded by `fsdp_lab.shard`.
        state_dict: needed on rank 0 only; other ranks may pass None.
    """
    state = sharding_state(model)
    group = state.groups.sync_group  # hybrid: rank 0's values reach every replica
    first = (dist.get_rank() if dist.is_initialized() else 0) == 0
    problem = _check_full(model, state, state_dict) if first else ""
    _raise_on_every_rank(state, problem)  # before any data moves: a lone raise hangs the rest
    with torch.no_grad():
        for unit in state.units:
            flat = unit.flat
            if flat.padded_numel == 0:
                continue
            # rank 0: (padded_numel,), zero padding, the shards' dtype; others: filled below
            full = flat.flatten(state_dict) if first else flat.shard.new_empty(flat.padded_numel)
            full = full.to(flat.device)  # sent from where the unit computes (offload: not host)
            comm.broadcast(full, src=0, group=group)
            flat.shard.copy_(flat.shard_of(full))  # in place: the optimizer keeps its Parameter
            unit.stale = True  # the next forward gathers the new values
        for name, buf in [*ignored_params(model, state), *persistent_buffers(model)]:
            if first:
                buf.copy_(state_dict[name])
            comm.broadcast(buf, src=0, group=group)


def _check_full(model: nn.Module, state: ShardingState, sd: dict | None) -> str:
    """Rank 0's verdict on a full state dict: "" if it fits the model, else what to fix."""
    if sd is None:
        return "state_dict=None on rank 0: rank 0 must pass the full state dict (others may not)"
    shapes = {n: b.shape for n, b in [*ignored_params(model, state), *persistent_buffers(model)]}
    for unit in state.units:
        for seg, names in zip(unit.flat.segments, unit.aliases, strict=True):
            shapes.update(dict.fromkeys(names, seg.shape))
    try:  # a malformed state dict must not leave the other ranks waiting
        missing, unexpected = [n for n in shapes if n not in sd], [n for n in sd if n not in shapes]
        if missing or unexpected:
            return (
                f"the state dict does not fit the model: missing keys {missing}, unexpected "
                f"keys {unexpected}. Fix: load a state dict of the same model class and config; "
                "rename or drop keys first (e.g. strip a 'module.' prefix)"
            )
        wrong = [
            f"{n} {tuple(sd[n].shape)} vs {tuple(s)}" for n, s in shapes.items() if sd[n].shape != s
        ]
        if wrong:
            return (
                f"shapes differ (state dict vs model): {wrong}. Fix: build the model with the "
                "config the state dict was saved from"
            )
        for first, *others in (names for unit in state.units for names in unit.aliases):
            for other in others:
                if not torch.equal(sd[first], sd[other].to(sd[first].device)):
                    return (
                        f"{first!r} and {other!r} are one (tied) parameter in the model but "
                        f"differ in the state dict. Fix: sd[{other!r}] = sd[{first!r}], or "
                        "untie the model"
                    )
    except Exception as exc:
        return f"could not check the state dict: {exc!r}"
    return ""


def _raise_on_every_rank(state: ShardingState, problem: str) -> None:
    """Rank 0's error message ("" for none) reaches every rank; every rank raises it."""
    problem = broadcast_text(state, problem, src=0, world=True)
    if problem:
        raise ValueError(problem)


def broadcast_text(state: ShardingState, text: str, src: int, world: bool = False) -> str:
    """Rank `src`'s `text` on every rank of the shard group (of the world with `world`): its
    length, then (if any) its UTF-8 bytes. `src` is a rank of that group."""
    group = None if world else state.group
    rank = dist.get_rank() if world else state.shard_rank
    root = dist.get_global_rank(group, src) if group is not None else src  # broadcast: global
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=state_device(state))
    size = torch.tensor([data.numel()], device=state_device(state))
    comm.broadcast(size, src=root, group=group)
    if size.item() == 0:
        return ""
    if rank != src:
        data = data.new_empty(int(size.item()))
    comm.broadcast(data, src=root, group=group)
    return bytes(data.tolist()).decode()


# -- gradient clipping --------------------------------------------------------------------------


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over the whole sharded gradient; same norm on all ranks.

    Args:
        model: a model sharded by `fsdp_lab.shard`, after backward.
        max_norm: the largest total gradient norm kept.
        norm_type: p of the p-norm (`math.inf`: the largest |g|).
    """
    state, p = sharding_state(model), float(norm_type)

    def local_norm(sharded: bool) -> torch.Tensor:  # (1,): sum of |g|^p, or max |g| for inf
        grads = [g for u in state.units if u.strategy.sharded == sharded for g in u.shard_grads()]
        norms = [torch.linalg.vector_norm(g, p).to(device) for g in grads if g.numel()]
        local = torch.stack(norms) if norms else torch.zeros(1, device=device)
        return local.max().reshape(1) if math.isinf(p) else local.pow(p).sum().reshape(1)

    # Each rank holds a slice of every sharded unit's gradient: add up the slices' sums of |g|^p
    # (for the inf-norm: take the largest maximum). A replicated unit's gradient is whole on
    # every rank: counted once, after. Padding has zero gradient; a tied weight sits in its
    # flat buffer once, so it counts once, as in torch (model.parameters() dedups it).
    device = state_device(state)
    local = local_norm(sharded=True)
    if any(u.strategy.sharded for u in state.units):
        op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
        comm.all_reduce(local, op=op, group=state.group)
    whole = local_norm(sharded=False)
    local = torch.maximum(local, whole) if math.isinf(p) else local + whole
    total = local[0] if math.isinf(p) else local[0].pow(1.0 / p)
    grads = [g for u in state.units for g in u.shard_grads() if g.numel()]
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch: multiplies even by 1
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers `model.state_dict()` holds (persistent ones), under every name."""
    return [
        (f"{mname}.{bname}" if mname else bname, buf)
        for mname, module in model.named_modules(remove_duplicate=False)
        for bname, buf in module._buffers.items()
        if buf is not None and bname not in module._non_persistent_buffers_set
    ]


def ignored_params(model: nn.Module, state: ShardingState) -> list[tuple[str, nn.Parameter]]:
    """The parameters no unit holds (`shard(ignored_params=...)`): whole, this rank's own."""
    held = {name for unit in state.units for names in unit.aliases for name in names}
    flats = {id(unit.flat.shard) for unit in state.units}  # use_orig_params=False: the shards
    named = model.named_parameters(remove_duplicate=False)
    return [(n, p) for n, p in named if n not in held and id(p) not in flats]


def state_device(state: ShardingState) -> torch.device:
    """Where the model computes: small messages about it (sizes, verdicts) go from there."""
    return state.units[0].flat.device
