"""Checkpoints of a sharded model (full or sharded), and gradient clipping across shards.

Between steps no rank holds a full parameter, so a checkpoint picks one of two layouts: FSDP1's
`FULL_STATE_DICT` / `SHARDED_STATE_DICT`, the two ways of `torch.distributed.checkpoint` (DCP).

    full     full_state_dict       all-gather each unit, unflatten: exactly `model.state_dict()`
                                   of the unsharded model, on rank 0. Loads anywhere (any world
                                   size, no fsdp_lab), but one rank holds the whole model.
             load_full_state_dict  rank 0 checks it and broadcasts each unit's flat buffer;
                                   every rank keeps its own slice (`shard_of`)
    sharded  save_sharded          every rank writes only its shards and optimizer state, in
                                   parallel (rank00001.pt); rank 0 writes meta.json last
             load_sharded          every rank reads its own file: no communication, but only
                                   into the same world size and wrap plan

`clip_grad_norm_` lives here too: like a checkpoint, it needs a global view (the norm of the
whole gradient) of something each rank holds only a slice of.

Where real FSDP goes further: DCP stores every parameter's shards with their offsets, so a
sharded checkpoint can be *resharded* on load to another world size, and it can write
asynchronously; FSDP2's `get_model_state_dict(model, options=StateDictOptions(
full_state_dict=True, cpu_offload=True))` is our `full_state_dict`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab import comm
from fsdp_lab.sharding.shard import ShardingState, sharding_state

META = "meta.json"

# -- full state dict ----------------------------------------------------------------------------


def full_state_dict(model: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter by original name (both names of a tied one) and buffer, full, on CPU.

    Args:
        model: a model sharded by `fsdp_lab.shard`.
        rank0_only: other ranks return {} (they still take part in every all-gather).
    """
    state = sharding_state(model)
    keep = state.rank == 0 or not rank0_only
    out: dict[str, torch.Tensor] = {}
    for unit in state.units:
        flat = unit.flat
        if flat.padded_numel == 0:  # a root unit left with no parameters
            continue
        # Not `unit.unshard()`: that gathers in the compute dtype (bf16 under mixed precision)
        # into the live buffer; a checkpoint wants the fp32 shards and leaves training alone.
        full = flat.shard.detach()  # replicated ("none"): the shard is the whole buffer
        if flat.shard_size > 1:
            full = torch.empty(flat.padded_numel, dtype=full.dtype, device=full.device)
            comm.all_gather_into_tensor(full, flat.shard.detach(), group=state.group)
        if keep:
            for view, names in zip(flat.unflatten(full).values(), unit.aliases, strict=True):
                # One copy shared by all names of a tied parameter: torch.save writes it once
                # and torch.load gives back one tensor under both names.
                out.update(dict.fromkeys(names, view.to("cpu", copy=True)))
    if not keep:
        return {}
    copies: dict[int, torch.Tensor] = {}
    for name, buf in _buffers(model):
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
    problem = _check_full(model, state, state_dict) if state.rank == 0 else ""
    _raise_on_every_rank(state, problem)  # before any data moves: a lone raise hangs the rest
    with torch.no_grad():
        for unit in state.units:
            flat = unit.flat
            if flat.padded_numel == 0:
                continue
            if state.rank == 0:
                full = flat.flatten(state_dict)  # (padded_numel,), zero padding, shards' dtype
            else:
                full = flat.shard.new_empty(flat.padded_numel)
            comm.broadcast(full, src=0, group=state.group)
            flat.shard.copy_(flat.shard_of(full))  # in place: the optimizer keeps its Parameter
            unit.stale = True  # the next forward gathers the new values
        for name, buf in _buffers(model):
            if state.rank == 0:
                buf.copy_(state_dict[name])
            comm.broadcast(buf, src=0, group=state.group)


def _check_full(model: nn.Module, state: ShardingState, sd: dict | None) -> str:
    """Rank 0's verdict on a full state dict: "" if it fits the model, else what to fix."""
    if sd is None:
        return "state_dict=None on rank 0: rank 0 must pass the full state dict (others may not)"
    shapes = {n: b.shape for n, b in _buffers(model)}
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
    """Broadcast rank 0's error message (length 0: none); every rank raises it."""
    text = torch.tensor(list(problem.encode()), dtype=torch.uint8, device=_device(state))
    size = torch.tensor([text.numel()], device=_device(state))
    comm.broadcast(size, src=0, group=state.group)
    if size.item() == 0:
        return
    if state.rank != 0:
        text = text.new_empty(int(size.item()))
    comm.broadcast(text, src=0, group=state.group)
    raise ValueError(bytes(text.tolist()).decode())


# -- sharded checkpoint -------------------------------------------------------------------------


def save_sharded(
    model: nn.Module, folder: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None
) -> Path:
    """Every rank writes its own shards (and optimizer state); then rank 0 writes meta.json.

    Args:
        model: a model sharded by `fsdp_lab.shard`.
        folder: the checkpoint folder, created if needed (one folder per checkpoint).
        optimizer: its state (sharded like the parameters) is saved beside the shards.
    """
    state, folder = sharding_state(model), Path(folder)

    def prepare() -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if state.rank == 0:  # until the new meta.json lands, the folder reads as incomplete
            (folder / META).unlink(missing_ok=True)

    def write_shards() -> None:
        payload = {
            "shards": {u.name: u.flat.shard.detach().cpu() for u in state.units},
            "buffers": {name: buf.detach().cpu() for name, buf in _buffers(model)},
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
        }
        _atomic_write(folder / f"rank{state.rank:05d}.pt", lambda f: torch.save(payload, f))

    def commit() -> None:  # like DCP's `.metadata`: written last, once every shard is on disk
        if state.rank == 0:
            text = json.dumps(_layout(model, state), indent=1).encode()
            _atomic_write(folder / META, lambda f: f.write(text))

    for step in (prepare, write_shards, commit):  # each ends with all ranks agreeing (a barrier)
        _on_every_rank(state, step, f"save_sharded ({step.__name__})")
    return folder


def load_sharded(
    model: nn.Module, folder: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Read back what `save_sharded` wrote, into the same world size and wrap plan.

    Args:
        model: a model sharded by `fsdp_lab.shard` as the saved one was.
        folder: the checkpoint folder.
        optimizer: built on `model.parameters()`; its state is restored too.
    """
    state, folder = sharding_state(model), Path(folder)
    saved: dict[str, Any] = {}

    def read() -> None:
        _check_meta(folder, model, state)
        path = folder / f"rank{state.rank:05d}.pt"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the checkpoint lacks this rank's file")
        saved.update(torch.load(path, map_location=_device(state), weights_only=True))
        if optimizer is not None and saved["optimizer"] is None:
            raise ValueError(f"{path} holds no optimizer state: it was saved without optimizer=")

    _on_every_rank(state, read, "load_sharded")
    # Every rank read a valid file: only now is anything overwritten (all ranks or none).
    with torch.no_grad():
        for unit in state.units:
            unit.flat.shard.copy_(saved["shards"][unit.name])
            unit.stale = True
        for name, buf in _buffers(model):
            buf.copy_(saved["buffers"][name])
    if optimizer is not None:
        optimizer.load_state_dict(saved["optimizer"])


def _layout(model: nn.Module, state: ShardingState) -> dict[str, Any]:
    """meta.json: what the rank files assume about the model and the world."""
    units = {
        u.name: {
            "padded_numel": u.flat.padded_numel,
            "shard_numel": u.flat.shard_numel,
            "segments": [[s.name, *s.shape] for s in u.flat.segments],
        }
        for u in state.units
    }
    buffers = {name: list(buf.shape) for name, buf in _buffers(model)}
    return dict(world_size=state.world, strategy=state.strategy, units=units, buffers=buffers)


def _check_meta(folder: Path, model: nn.Module, state: ShardingState) -> None:
    if not folder.is_dir():
        raise FileNotFoundError(f"no sharded checkpoint at {folder}: the folder does not exist")
    if not (folder / META).is_file():
        raise FileNotFoundError(
            f"{folder / META} not found: not a complete sharded checkpoint (save_sharded "
            "writes meta.json last, once every rank's file is written)"
        )
    saved, mine = json.loads((folder / META).read_text()), _layout(model, state)
    old, new = saved["units"], mine["units"]
    differ = sorted(repr(n) for n in old.keys() | new.keys() if old.get(n) != new.get(n))
    if saved["world_size"] != mine["world_size"]:
        what = (
            f"it was saved by {saved['world_size']} ranks, this run has {mine['world_size']} "
            "(each rank file holds the slices cut for its world size)"
        )
    elif differ or saved["buffers"] != mine["buffers"]:
        what = (
            f"units {differ} (or buffers) differ in parameters or shard sizes (saved with "
            f"strategy {saved['strategy']!r}, this model uses {mine['strategy']!r})"
        )
    else:
        return
    raise ValueError(
        f"{folder} does not fit this model: {what}. Fix: load it with the world size, strategy "
        "and wrap units it was saved with, or save/load a full state dict instead "
        "(full_state_dict / load_full_state_dict): it fits any world size"
    )


def _atomic_write(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Write a temp file in the same folder, then rename it: a crash leaves the old file or the
    new one, never half of one (os.replace is atomic within a filesystem)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _on_every_rank(state: ShardingState, step: Callable[[], None], what: str) -> None:
    """Run `step` here, then agree: if it failed on any rank, every rank raises."""
    error: Exception | None = None
    try:
        step()
    except Exception as exc:  # held until every rank has reported, so that none waits forever
        error = exc
    failed = torch.tensor([float(error is not None)], device=_device(state))
    comm.all_reduce(failed, group=state.group)  # 4 bytes, and a barrier
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError(f"{what} failed on {int(failed.item())} other rank(s): see their errors")


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
    grads = [u.flat.shard.grad for u in state.units if u.flat.shard.grad is not None]
    # Each rank holds a slice of every unit's gradient: add up the slices' sums of |g|^p (for
    # the inf-norm: take the largest maximum). Padding has zero gradient; a tied weight sits in
    # its flat buffer once, so it counts once, as in torch (model.parameters() dedups it).
    norms = [torch.linalg.vector_norm(g, p) for g in grads]
    local = torch.stack(norms) if norms else torch.zeros(1, device=_device(state))
    local = local.max().reshape(1) if math.isinf(p) else local.pow(p).sum().reshape(1)
    if state.units[0].strategy.sharded:  # replicated ("none"): every rank has the whole grad
        op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
        comm.all_reduce(local, op=op, group=state.group)
    total = local[0] if math.isinf(p) else local[0].pow(1.0 / p)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch: multiplies even by 1
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


def _buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers `model.state_dict()` holds (persistent ones), under every name."""
    return [
        (f"{mname}.{bname}" if mname else bname, buf)
        for mname, module in model.named_modules(remove_duplicate=False)
        for bname, buf in module._buffers.items()
        if buf is not None and bname not in module._non_persistent_buffers_set
    ]


def _device(state: ShardingState) -> torch.device:
    return state.units[0].flat.shard.device
