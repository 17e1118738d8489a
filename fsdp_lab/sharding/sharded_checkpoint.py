"""Sharded checkpoints, crash-safe: every rank writes its own shards, rank 0 commits.

FSDP1's `SHARDED_STATE_DICT`, torch.distributed.checkpoint's way: no data moves between ranks,
but the checkpoint loads only into the same world size and wrap plan.

    save_sharded   every rank writes only its shards and optimizer state, in parallel, into a
                   new version folder; then rank 0 switches meta.json to it
    load_sharded   every rank reads its own file and checks it against meta.json (size, sha256,
                   rank)

[Note: crash-safe sharded checkpoints] A sharded checkpoint is a folder:

    meta.json            the commit record: which version is current, world size, strategy,
                         units, buffers, and for each rank file its size and sha256
    journal.json         the version folders this checkpoint's saves made, each with the
                         device and inode it had (the only ones a save may ever remove)
    v00002/rank00000.pt  rank 0's shards, buffers and optimizer state, with its rank and world size
    v00002/rank00001.pt

A save never touches the files meta.json names. It writes the next version folder (v00003/),
then rank 0 replaces meta.json with one `os.replace`, atomic, once every rank's file is on disk;
only after that switch are the old version and the leftovers of crashed saves removed. A kill at
any moment leaves the old checkpoint or the new one, never neither. The checksums make a load
refuse swapped, truncated or edited files, on every rank, instead of loading wrong tensors.

What a save makes and may remove in the folder is `checkpoint_folders`' (a save deletes only
what it wrote, never through a link); every file is written new and whole
(`fsdp_lab.outputs.write_file`); a write that fails (a full disk) says so and leaves the
committed checkpoint as it was.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab import comm
from fsdp_lab.outputs import read_file, write_file
from fsdp_lab.sharding.checkpoint_folders import (
    MAX_RECORD_BYTES,
    META,
    forget_uncommitted,
    new_version_folder,
    rank_name,
    remove_superseded,
    version_folder,
    version_name,
)
from fsdp_lab.sharding.state import ShardingState, sharding_state
from fsdp_lab.sharding.state_dict import broadcast_text, persistent_buffers, state_device

_META_KEYS = dict(version=int, world_size=int, strategy=str, units=dict, buffers=dict, files=list)


class CorruptCheckpointError(ValueError):
    """A sharded checkpoint's files are not what its meta.json records, or meta.json is no such
    record. Raised on every rank alike."""


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
    state = sharding_state(model)
    replicas = state.groups.replicate_group
    if replicas is None:
        return _save_in_group(model, Path(folder), optimizer, state)
    # Hybrid: the replicas hold the same shards, so the first replica's shard group writes the
    # checkpoint (S files, not N), the others wait for its outcome and raise its error too.
    error: Exception | None = None
    if dist.get_rank(replicas) == 0:
        try:
            _save_in_group(model, Path(folder), optimizer, state)
        except Exception as exc:  # held until the replicas know, so that none waits forever
            error = exc
    message = broadcast_text(state, "" if error is None else str(error) or repr(error), 0, True)
    if error is not None:
        raise error
    if message:
        raise RuntimeError(f"save_sharded failed in the first replica: {message}")
    return Path(folder)


def _save_in_group(
    model: nn.Module, folder: Path, optimizer: torch.optim.Optimizer | None, state: ShardingState
) -> Path:
    """`save_sharded` on the ranks of one shard group (every rank, unless hybrid)."""
    version = torch.zeros(1, dtype=torch.int64, device=state_device(state))
    written: list[tuple[int, str]] = []  # (bytes, sha256) of this rank's file

    def prepare() -> None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if state.shard_rank == 0:  # a version folder of its own, made new and journaled
                version.fill_(new_version_folder(folder, _committed_version(folder)))
        except OSError as exc:  # a full disk, a folder it may not write
            raise OSError(exc.errno, f"save_sharded could not start a new version in {folder}: "
                          f"{exc.strerror or exc}. {UNCHANGED}") from exc  # fmt: skip

    def write_shards() -> None:
        payload = {
            "rank": state.shard_rank,  # inside the file, so that a renamed file cannot pass as another
            "world_size": state.shard_size,
            "shards": {u.name: u.flat.shard.detach().cpu() for u in state.units},
            "buffers": {name: buf.detach().cpu() for name, buf in persistent_buffers(model)},
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
        }
        name = rank_name(state.shard_rank)
        try:
            with version_folder(folder, int(version.item())) as here:
                written.append(write_file(name, lambda f: torch.save(payload, f), folder=here))
        except OSError as exc:  # a full disk, a quota: said plainly, not as torch's "enforce fail"
            raise OSError(exc.errno, f"writing {folder / version_name(int(version.item())) / name}"
                          f": {exc.strerror or exc}. {UNCHANGED}") from exc  # fmt: skip

    def commit(records: list[dict[str, Any]]) -> None:  # the switch from the old version
        if state.shard_rank == 0:
            meta = dict(version=int(version.item()), **_layout(model, state), files=records)
            write_file(folder / META, json.dumps(meta, indent=1))

    def clean_up() -> None:  # only now: a crash before the switch needed the old files
        if state.shard_rank == 0:
            remove_superseded(folder, int(version.item()))

    _on_every_rank(state, prepare, "save_sharded (prepare)")
    root = dist.get_global_rank(state.group, 0) if state.group is not None else 0
    comm.broadcast(version, src=root, group=state.group)  # every rank writes into rank 0's choice
    try:
        _on_every_rank(state, write_shards, "save_sharded (write_shards)")  # all files on disk
        records = _gather_file_records(state, *written[0])  # for meta.json, so loads can check
        _on_every_rank(state, lambda: commit(records), "save_sharded (commit)")
    except BaseException:  # failed or interrupted (Ctrl-C) before the switch: its own files go
        forget_uncommitted(
            folder, int(version.item()), state.shard_rank, _committed_version(folder)
        )
        raise
    _on_every_rank(state, clean_up, "save_sharded (clean_up)")
    return folder


UNCHANGED = (
    "The checkpoint the folder held before is unchanged (this save was not committed). Fix: "
    "free space there, or save elsewhere"
)


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
        path = folder / version_name(meta["version"]) / rank_name(state.shard_rank)
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the checkpoint lacks this rank's file")
        try:  # a FIFO or /dev/zero in its place is refused, never read
            data = read_file(path, meta["files"][state.shard_rank]["bytes"] + (1 << 20))
        except ValueError as exc:
            raise CorruptCheckpointError(f"{exc}: not the file meta.json records. Fix: copy "
                                         "the checkpoint folder again, or re-save it") from None  # fmt: skip
        _check_file(path, data, meta["files"], state.shard_rank)
        payload = torch.load(io.BytesIO(data), map_location=state_device(state), weights_only=True)
        if (payload.get("rank"), payload.get("world_size")) != (state.shard_rank, state.shard_size):
            raise CorruptCheckpointError(
                f"{path} records rank {payload.get('rank')} of {payload.get('world_size')} "
                f"ranks, expected rank {state.shard_rank} of {state.shard_size}: meta.json and the rank "
                "files come from different saves. Fix: re-save the checkpoint"
            )
        _check_contents(path, payload, state, model)
        saved.update(payload)
        if optimizer is not None and saved["optimizer"] is None:
            raise ValueError(f"{path} holds no optimizer state: it was saved without optimizer=")

    _on_every_rank(state, read, "load_sharded")
    # Every rank read a valid file: only now is anything overwritten (all ranks or none).
    with torch.no_grad():
        for unit in state.units:
            unit.flat.shard.copy_(saved["shards"][unit.name])
            unit.stale = True
        for name, buf in persistent_buffers(model):
            buf.copy_(saved["buffers"][name])
    if optimizer is not None:
        optimizer.load_state_dict(saved["optimizer"])


def _gather_file_records(state: ShardingState, size: int, sha256: str) -> list[dict[str, Any]]:
    """Every rank's (bytes, sha256), in rank order, on every rank: 40 bytes per rank.

    Only rank 0 writes them, but comm has no gather, and an all-gather of 40 bytes costs nothing.
    """
    mine = torch.tensor(
        list(size.to_bytes(8, "little") + bytes.fromhex(sha256)),
        dtype=torch.uint8,
        device=state_device(state),
    )
    every = mine.new_empty(state.shard_size * mine.numel())
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
    buffers = {name: list(buf.shape) for name, buf in persistent_buffers(model)}
    return dict(
        world_size=state.shard_size, strategy=state.strategy.name, units=units, buffers=buffers
    )


def _committed_version(folder: Path) -> int | None:
    """The version meta.json commits to, if it is a record of save_sharded's."""
    try:
        return _read_meta(folder)["version"]
    except (OSError, ValueError):
        return None


def _read_meta(folder: Path) -> dict[str, Any]:
    """meta.json, checked to be a commit record of `save_sharded` (not its fit to the model)."""
    path = folder / META
    if not folder.is_dir():
        raise FileNotFoundError(f"no sharded checkpoint at {folder}: the folder does not exist")
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: not a complete sharded checkpoint (save_sharded writes meta.json "
            "last, once every rank's file is written). Ranks on several machines need a folder "
            "every node mounts"
        )
    try:
        meta = json.loads(read_file(path, MAX_RECORD_BYTES))
        why = _meta_problem(meta)
    except ValueError as exc:  # not a regular file of bounded size, JSONDecodeError, UTF-8
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


def _check_contents(path: Path, payload: Any, state: ShardingState, model: nn.Module) -> None:
    """Every unit's shard and every persistent buffer in `payload`, each of the shape and dtype
    the model holds: a file whose checksum passes (meta.json rewritten with it) but whose
    tensors do not fit would otherwise be broadcast or converted into the model silently."""
    shards, buffers = payload.get("shards"), payload.get("buffers")
    if not isinstance(shards, dict) or not isinstance(buffers, dict):
        problem = "it holds no 'shards' and 'buffers' dicts"
    else:
        wanted = {u.name: u.flat.shard for u in state.units}
        wanted_buffers = dict(persistent_buffers(model))
        problem = _misfit("unit", shards, wanted) or _misfit("buffer", buffers, wanted_buffers)
    if problem:
        raise CorruptCheckpointError(
            f"{path}: {problem}, unlike this model's (written by another model or edited). "
            "Fix: load it into the model, world size and wrap plan it was saved from, or re-save"
        )


def _misfit(kind: str, got: dict[str, Any], wanted: dict[str, torch.Tensor]) -> str:
    """The first difference between `got` and the tensors `wanted`, in words ("" if none)."""
    for name, like in wanted.items():
        t = got.get(name)
        if not isinstance(t, torch.Tensor):
            return f"{kind} {name!r} is missing"
        if t.shape != like.shape or t.dtype != like.dtype:
            return (
                f"{kind} {name!r} is {t.dtype} of shape {tuple(t.shape)}, the model's "
                f"{like.dtype} of shape {tuple(like.shape)}"
            )
    extra = sorted(set(got) - set(wanted))
    return f"{kind} {extra[0]!r} is not in the model" if extra else ""


def _check_file(path: Path, data: bytes, records: list[dict[str, Any]], rank: int) -> None:
    """`data` (read from `path`) is exactly the file rank `rank` wrote, as meta.json records."""
    digest, expected = hashlib.sha256(data).hexdigest(), records[rank]
    if (len(data), digest) == (expected["bytes"], expected["sha256"]):
        return
    owners = [k for k, record in enumerate(records) if record["sha256"] == digest]
    if owners:
        what = f"it holds rank {owners[0]}'s shards, not rank {rank}'s (files swapped or renamed)"
        fix = f"give each file its rank's name (this one: {rank_name(owners[0])})"
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
    codes = torch.zeros(state.shard_size, device=state_device(state))
    if error is not None:
        codes[state.shard_rank] = 2.0 if isinstance(error, CorruptCheckpointError) else 1.0
    comm.all_reduce(codes, group=state.group)
    failed = codes.nonzero().flatten().tolist()
    if not failed:
        return
    first = failed[0]
    message = broadcast_text(state, str(error) if state.shard_rank == first else "", src=first)
    if error is not None:
        raise error
    if codes[first].item() == 2.0:
        raise CorruptCheckpointError(f"rank {first}: {message}")
    raise RuntimeError(f"{what} failed on rank(s) {failed}; rank {first}: {message}")
