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

[Note: crash-safe sharded checkpoints] A sharded checkpoint is a folder:

    meta.json            the commit record: which version is current, world size, strategy,
                         units, buffers, and for each rank file its size and sha256
    v00002/rank00000.pt  rank 0's shards, buffers and optimizer state, with its rank and world size
    v00002/rank00001.pt

A save never touches the files meta.json names. It writes the next version folder (v00003/),
then rank 0 replaces meta.json with one `os.replace`, atomic, once every rank's file is on disk;
only after that switch are the old version and the leftovers of crashed saves removed. A kill at
any moment leaves the old checkpoint or the new one, never neither. The checksums make a load
refuse swapped, truncated or edited files, on every rank, instead of loading wrong tensors.

`clip_grad_norm_` lives here too: like a checkpoint, it needs a global view (the norm of the
whole gradient) of something each rank holds only a slice of.

Where real FSDP goes further: DCP stores every parameter's shards with their offsets, so a
sharded checkpoint can be *resharded* on load to another world size, and it can write
asynchronously (its `.metadata` file is, like our meta.json, written last); FSDP2's
`get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))`
is our `full_state_dict`.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import shutil
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
_VERSION = re.compile(r"v(\d{5,})")  # a version folder of rank files: v00001, v00002, ...
# What else save_sharded may leave in a folder and so may remove: temp files of interrupted
# atomic writes, and rank files of the layout before version folders. Nothing else is touched.
_LEFTOVER = re.compile(r"\.(meta\.json|rank\d{5}\.pt)\..*\.tmp|rank\d{5}\.pt")
_META_KEYS = dict(version=int, world_size=int, strategy=str, units=dict, buffers=dict, files=list)


class CorruptCheckpointError(ValueError):
    """A sharded checkpoint's files are not what its meta.json records, or meta.json is no such
    record. Raised on every rank alike."""


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
    """Rank 0's error message ("" for none) reaches every rank; every rank raises it."""
    problem = _broadcast_text(state, problem, src=0)
    if problem:
        raise ValueError(problem)


def _broadcast_text(state: ShardingState, text: str, src: int) -> str:
    """Rank `src`'s `text` on every rank: its length, then (if any) its UTF-8 bytes."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=_device(state))
    size = torch.tensor([data.numel()], device=_device(state))
    comm.broadcast(size, src=src, group=state.group)
    if size.item() == 0:
        return ""
    if state.rank != src:
        data = data.new_empty(int(size.item()))
    comm.broadcast(data, src=src, group=state.group)
    return bytes(data.tolist()).decode()


# -- sharded checkpoint -------------------------------------------------------------------------


def save_sharded(
    model: nn.Module, folder: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None
) -> Path:
    """Every rank writes its shards into a new version folder; then rank 0 switches meta.json.

    A crash at any point leaves the checkpoint that `folder` held before, or the new one.

    Args:
        model: a model sharded by `fsdp_lab.shard`.
        folder: the checkpoint folder, created if needed (one folder per checkpoint).
        optimizer: its state (sharded like the parameters) is saved beside the shards.
    """
    state, folder = sharding_state(model), Path(folder)
    version = torch.zeros(1, dtype=torch.int64, device=_device(state))
    written: list[tuple[int, str]] = []  # (bytes, sha256) of this rank's file

    def prepare() -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if state.rank == 0:  # past every version here: the current one and crashed saves' ones
            version.fill_(1 + max(_versions(folder), default=0))

    def write_shards() -> None:
        payload = {
            "rank": state.rank,  # inside the file, so that a renamed file cannot pass as another
            "world_size": state.world,
            "shards": {u.name: u.flat.shard.detach().cpu() for u in state.units},
            "buffers": {name: buf.detach().cpu() for name, buf in _buffers(model)},
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
        }
        path = folder / _version_name(int(version.item())) / _rank_name(state.rank)
        path.parent.mkdir(exist_ok=True)
        written.append(_atomic_write(path, lambda f: torch.save(payload, f)))

    def commit(records: list[dict[str, Any]]) -> None:  # the switch from the old version
        if state.rank == 0:
            meta = dict(version=int(version.item()), **_layout(model, state), files=records)
            text = json.dumps(meta, indent=1).encode()
            _atomic_write(folder / META, lambda f: f.write(text))

    def clean_up() -> None:  # only now: a crash before the switch needed the old files
        if state.rank == 0:
            _remove_superseded(folder, int(version.item()))

    _on_every_rank(state, prepare, "save_sharded (prepare)")
    comm.broadcast(version, src=0, group=state.group)  # every rank writes into rank 0's choice
    _on_every_rank(state, write_shards, "save_sharded (write_shards)")  # all files on disk
    records = _gather_file_records(state, *written[0])  # for meta.json, so loads can check
    _on_every_rank(state, lambda: commit(records), "save_sharded (commit)")
    _on_every_rank(state, clean_up, "save_sharded (clean_up)")
    return folder


def load_sharded(
    model: nn.Module, folder: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Read back what `save_sharded` wrote, into the same world size and wrap plan.

    Raises `CorruptCheckpointError` on every rank if meta.json or any rank file is not what the
    save wrote (swapped, truncated, edited), before any value is overwritten.

    Args:
        model: a model sharded by `fsdp_lab.shard` as the saved one was.
        folder: the checkpoint folder.
        optimizer: built on `model.parameters()`; its state is restored too.
    """
    state, folder = sharding_state(model), Path(folder)
    saved: dict[str, Any] = {}

    def read() -> None:
        meta = _read_meta(folder)
        _check_fits(folder, meta, model, state)
        path = folder / _version_name(meta["version"]) / _rank_name(state.rank)
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the checkpoint lacks this rank's file")
        data = path.read_bytes()
        _check_file(path, data, meta["files"], state.rank)
        payload = torch.load(io.BytesIO(data), map_location=_device(state), weights_only=True)
        if (payload.get("rank"), payload.get("world_size")) != (state.rank, state.world):
            raise CorruptCheckpointError(
                f"{path} records rank {payload.get('rank')} of {payload.get('world_size')} "
                f"ranks, expected rank {state.rank} of {state.world}: meta.json and the rank "
                "files come from different saves. Fix: re-save the checkpoint"
            )
        saved.update(payload)
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


def _version_name(version: int) -> str:
    return f"v{version:05d}"


def _rank_name(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def _versions(folder: Path) -> list[int]:
    return [int(m[1]) for e in folder.iterdir() if (m := _VERSION.fullmatch(e.name)) and e.is_dir()]


class _Sha256Writer:
    """Passes writes on to a file and hashes them: the digest of exactly the bytes written."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.sha256, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += memoryview(data).nbytes
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _atomic_write(path: Path, write: Callable[[_Sha256Writer], object]) -> tuple[int, str]:
    """Write a temp file in the same folder, then rename it: a crash leaves the old file or the
    new one, never half of one (os.replace is atomic within a filesystem). Returns the size and
    sha256 of the bytes written."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            hashed = _Sha256Writer(f)
            write(hashed)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)  # and the rename itself, with any new folder entries beside it
    return hashed.size, hashed.sha256.hexdigest()


def _fsync_folder(folder: Path) -> None:
    if os.name != "posix":  # Windows cannot open a folder to fsync it
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _gather_file_records(state: ShardingState, size: int, sha256: str) -> list[dict[str, Any]]:
    """Every rank's (bytes, sha256), in rank order, on every rank: 40 bytes per rank.

    Only rank 0 writes them, but comm has no gather, and an all-gather of 40 bytes costs nothing.
    """
    mine = torch.tensor(
        list(size.to_bytes(8, "little") + bytes.fromhex(sha256)),
        dtype=torch.uint8,
        device=_device(state),
    )
    every = mine.new_empty(state.world * mine.numel())
    comm.all_gather_into_tensor(every, mine, group=state.group)
    rows = bytes(every.tolist())
    return [
        {"bytes": int.from_bytes(rows[i : i + 8], "little"), "sha256": rows[i + 8 : i + 40].hex()}
        for i in range(0, len(rows), 40)
    ]


def _layout(model: nn.Module, state: ShardingState) -> dict[str, Any]:
    """What the rank files assume about the model and the world (part of meta.json)."""
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


def _remove_superseded(folder: Path, current: int) -> None:
    """Older version folders, and files of interrupted saves; never anything we did not write."""
    for entry in folder.iterdir():
        version = _VERSION.fullmatch(entry.name)
        if version and entry.is_dir() and int(version[1]) != current:
            shutil.rmtree(entry)
        elif _LEFTOVER.fullmatch(entry.name) and entry.is_file():
            entry.unlink()


def _read_meta(folder: Path) -> dict[str, Any]:
    """meta.json, checked to be a commit record of `save_sharded` (not its fit to the model)."""
    path = folder / META
    if not folder.is_dir():
        raise FileNotFoundError(f"no sharded checkpoint at {folder}: the folder does not exist")
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: not a complete sharded checkpoint (save_sharded writes meta.json "
            "last, once every rank's file is written)"
        )
    try:
        meta = json.loads(path.read_bytes())
        why = _meta_problem(meta)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        meta, why = None, f"not JSON ({exc})"
    if not why:
        return meta
    raise CorruptCheckpointError(
        f"{path} is not a valid sharded-checkpoint metadata file: {why}. Fix: re-save the "
        "checkpoint with save_sharded, or point load_sharded at the folder save_sharded wrote"
    )


def _meta_problem(meta: Any) -> str:
    """What keeps `meta` from being a commit record of save_sharded ("" if nothing)."""
    if not isinstance(meta, dict):
        return f"a JSON {type(meta).__name__}, not an object"
    wrong = [k for k, kind in _META_KEYS.items() if not isinstance(meta.get(k), kind)]
    if wrong:
        return f"keys missing or of the wrong type: {wrong}"
    records = meta["files"]
    if len(records) != meta["world_size"] or not all(
        isinstance(r, dict) and isinstance(r.get("bytes"), int) and isinstance(r.get("sha256"), str)
        for r in records
    ):
        return "'files' does not hold one {bytes, sha256} record per rank"
    return ""


def _check_fits(
    folder: Path, saved: dict[str, Any], model: nn.Module, state: ShardingState
) -> None:
    mine = _layout(model, state)
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


def _check_file(path: Path, data: bytes, records: list[dict[str, Any]], rank: int) -> None:
    """`data` (read from `path`) is exactly the file rank `rank` wrote, as meta.json records."""
    digest, expected = hashlib.sha256(data).hexdigest(), records[rank]
    if (len(data), digest) == (expected["bytes"], expected["sha256"]):
        return
    owners = [k for k, record in enumerate(records) if record["sha256"] == digest]
    if owners:
        what = f"it holds rank {owners[0]}'s shards, not rank {rank}'s (files swapped or renamed)"
        fix = f"give each file its rank's name (this one: {_rank_name(owners[0])})"
    elif len(data) != expected["bytes"]:
        what = (
            f"meta.json records {expected['bytes']} bytes, the file has {len(data)} "
            "(truncated, or an unfinished copy)"
        )
        fix = "copy the checkpoint folder again from where it was saved, or re-save it"
    else:
        what = (
            f"its sha256 is {digest[:16]}..., meta.json records {expected['sha256'][:16]}... "
            "(edited, or corrupted on disk)"
        )
        fix = "copy the checkpoint folder again from where it was saved, or re-save it"
    raise CorruptCheckpointError(f"{path}: {what}. Fix: {fix}")


def _on_every_rank(state: ShardingState, step: Callable[[], None], what: str) -> None:
    """Run `step` here, then agree: if it failed on any rank, every rank raises.

    A failed rank raises its own error; the others learn the first failed rank's message and
    raise it too (as `CorruptCheckpointError` if it was one), so every rank names the problem.
    """
    error: Exception | None = None
    try:
        step()
    except Exception as exc:  # held until every rank has reported, so that none waits forever
        error = exc
    # Per rank: 0 done, 1 failed, 2 found a corrupt checkpoint. 4N bytes, and a barrier.
    codes = torch.zeros(state.world, device=_device(state))
    if error is not None:
        codes[state.rank] = 2.0 if isinstance(error, CorruptCheckpointError) else 1.0
    comm.all_reduce(codes, group=state.group)
    failed = codes.nonzero().flatten().tolist()
    if not failed:
        return
    first = failed[0]
    message = _broadcast_text(state, str(error) if state.rank == first else "", src=first)
    if error is not None:
        raise error
    if codes[first].item() == 2.0:
        raise CorruptCheckpointError(f"rank {first}: {message}")
    raise RuntimeError(f"{what} failed on rank(s) {failed}; rank {first}: {message}")


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
    grads = [g for u in state.units for g in u.shard_grads() if g.numel()]
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
