"""Audit: one INVALID wrapping — a tied embedding and head in separate units — run through
PyTorch's FSDPs and ours.

TinyGPT's `head.weight` *is* `tok_emb.weight` (one Parameter, two owners). Put `head` in a unit
of its own while the embedding stays in the root, and each unit would gather, update and free
its own copy of that Parameter: the tie can silently break. `fsdp_lab.shard` refuses such a plan
(`PlanError`, before any collective). What do FSDP1 (both flat-parameter modes) and FSDP2
(`fully_shard`) do? This module does not say: `audit_worker` measures it on the installed torch,
one forward + backward + SGD step per system, and `audit_table` prints what it measured. The
table is computed at run time, never written by hand — a new torch may answer differently.

On TinyGPT by default, or on any model with a tie (``fsdp-lab tying --model module:factory``):
the last owner of its first tie (TinyGPT's `head`) becomes a unit of its own, the others stay
in the root.

Every stage runs inside try/except on every rank; the ranks then agree (`all_gather_object` on
the default group) on whether everyone succeeded before going on, so a failure on one rank is
recorded on all. The wrapped model talks on a fresh group with a short timeout, so a rank left
waiting in a collective its peer never joined gets an error, not a hang.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fsdp_lab.model_spec import load_factory, vocab_size_of
from fsdp_lab.models import synthetic_batch, tiny_gpt
from fsdp_lab.reference import local_slice
from fsdp_lab.tying import Tie, find_ties

SYSTEMS = (
    "fsdp1 use_orig_params=False",
    "fsdp1 use_orig_params=True",
    "fsdp2 fully_shard",
    "fsdp_lab shard",
)
STAGES = ("wrap", "forward", "backward", "step")
COLLECTIVE_TIMEOUT_S = 20  # a rank stuck in a collective its peer left gives up after this


def block_names(model: nn.Module) -> list[str]:
    """The repeated blocks (a transformer's layers): children of the outermost ModuleLists."""
    blocks: list[str] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(b + ".") for b in blocks)
        if isinstance(module, nn.ModuleList) and not inside:
            blocks += [f"{name}.{i}" for i in range(len(module))]
    return blocks


def split_tie(model: nn.Module) -> tuple[Tie, str]:
    """The model's first tie, and the owner the audit puts in a unit of its own (the last)."""
    ties = find_ties(model)
    if not ties:
        raise ValueError(f"the {type(model).__name__} has no tied parameters (find_ties: none)")
    return ties[0], ties[0].modules[-1]


def _wrap(system: str, model: nn.Module, group: dist.ProcessGroup, split: str) -> nn.Module:
    """Wrap `model` so that `split` (TinyGPT: `head`) is a unit of its own, its tied partner in
    the root."""
    if system.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        head = model.get_submodule(split)
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: m is head)
        return FullyShardedDataParallel(
            model,
            process_group=group,
            auto_wrap_policy=policy,
            device_id=torch.device("cpu"),
            use_orig_params=system.endswith("True"),
        )
    if system == "fsdp2 fully_shard":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, "cpu")
        fully_shard(model.get_submodule(split), mesh=mesh)
        for block in block_names(model):
            fully_shard(model.get_submodule(block), mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if system == "fsdp_lab shard":
        from fsdp_lab.sharding.shard import shard

        return shard(model, units=[split], mesh=group)
    raise ValueError(f"unknown system {system!r}; one of {SYSTEMS}")


def _inner(model: nn.Module) -> nn.Module:
    """The model under an FSDP1 wrapper (or the model itself)."""
    return getattr(model, "_fsdp_wrapped_module", model)


def _tied_pair(inner: nn.Module, names: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    # Attribute by attribute (`inner.tok_emb.weight`), as FSDP1 exposes them: a wrapped
    # submodule forwards the attribute, and summon_full_params sets plain tensors.
    first, last = (functools.reduce(getattr, n.split("."), inner) for n in (names[0], names[-1]))
    return first, last


def _check_tie(model: nn.Module, tie: Tie) -> tuple[bool, bool]:
    """(still_tied, equal_values) of the tie's first and last weights, full, after the step."""
    inner = _inner(model)
    if type(model).__name__ == "FullyShardedDataParallel":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            emb, head = _tied_pair(inner, tie.names)
            tied = emb is head or emb.data_ptr() == head.data_ptr()
            return tied, bool(torch.equal(emb.detach(), head.detach()))
    emb, head = _tied_pair(inner, tie.names)
    tied = emb is head  # FSDP2: the same DTensor Parameter registered on both modules
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in (emb, head)]
    return tied, bool(torch.equal(full[0].detach(), full[1].detach()))


def _agree(stage_fn: Callable[[], Any]) -> tuple[bool, Any, str | None]:
    """Run `stage_fn` here; return (every rank succeeded, its result, the first failure)."""
    try:
        result, error = stage_fn(), None
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        result, error = None, f"{type(exc).__name__}: {first_line}"
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)  # default group: never the one the model broke
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return True, result, None
    if len(failed) == len(errors) and len({e for _, e in failed}) == 1:
        return False, None, failed[0][1]
    return False, None, "; ".join(f"rank {r}: {e}" for r, e in failed)


def audit_system(
    system: str, model_spec: str | None = None, vocab_size: int | None = None, lr: float = 0.5
) -> dict:
    """One system's row: wrap the model (TinyGPT, or `model_spec`'s) invalidly, try one
    training step, inspect the tie. `vocab_size`: default `vocab_size_of(model)`."""
    torch.manual_seed(0)
    model = load_factory(model_spec)() if model_spec is not None else tiny_gpt()
    tie, split = split_tie(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    row: dict[str, Any] = {"system": system, "accepted": False, "stage": None, "error": None}
    row.update(still_tied=None, equal_values=None)
    vocab = vocab_size if vocab_size is not None else vocab_size_of(model)
    x, y = synthetic_batch(vocab, 2 * world, 8, 0)  # (B, T) tokens
    x, y = local_slice(x, rank, world), local_slice(y, rank, world)
    box: dict[str, Any] = {}

    def forward() -> None:
        logits = box["model"](x)  # (B, T, V)
        box["loss"] = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    stages: dict[str, Callable[[], Any]] = {
        "wrap": lambda: box.update(model=_wrap(system, model, group, split)),
        "forward": forward,
        "backward": lambda: box["loss"].backward(),
        "step": lambda: torch.optim.SGD(box["model"].parameters(), lr=lr).step(),
    }
    for stage in STAGES:
        ok, _, error = _agree(stages[stage])
        if not ok:
            row.update(stage=stage, error=error)
            return row
    row["accepted"] = True
    ok, held, error = _agree(lambda: _check_tie(box["model"], tie))
    if ok:
        row["still_tied"], row["equal_values"] = held
    else:
        row["error"] = f"tie check failed: {error}"
    # `group` is left alive: FSDP2's DeviceMesh keeps it registered, and destroying it makes
    # later meshes on this rank fail to resolve it ("Could not resolve the process group").
    return row


def audit_worker(model_spec: str | None = None, vocab_size: int | None = None) -> list[dict]:
    """Run on every rank of a cluster: one row per system in `SYSTEMS`, the same on every rank.

    Args:
        model_spec: "module:factory" of a model with a tie (default: TinyGPT).
        vocab_size: token ids are drawn below it (default: `vocab_size_of(model)`).
    """
    return [audit_system(system, model_spec, vocab_size) for system in SYSTEMS]


def audit_table(results: list[dict]) -> str:
    """A markdown table of `audit_worker`'s rows (one rank's list)."""

    def cell(value: Any) -> str:
        return "—" if value is None else str(value).replace("|", "\\|")

    columns = ("system", "accepted", "stage", "still_tied", "equal_values", "error")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in results]
    return "\n".join(lines)
