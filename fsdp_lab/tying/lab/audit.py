"""Lab 03, the live audit: one INVALID plan — the tie's last owner (TinyGPT's `head`) in a unit
of its own, its partner in the root (`plans.split_tie`) — through PyTorch's FSDPs and ours.

Each unit would gather, update and free its own copy of the tied Parameter: the tie can
silently break. `fsdp_lab.shard` refuses the plan (`PlanError`, before any collective). What do
FSDP1 (both flat-parameter modes) and FSDP2 (`fully_shard`) do? Nothing here says: one forward
+ backward + SGD step per system measures it on the installed torch (a new one may answer
differently); `report.audit_table` prints the rows.

Every stage runs inside try/except on every rank, and the ranks agree (`all_gather_object` on
the default group) on whether all succeeded before going on, so a failure on one rank is
recorded on all. The wrapped model talks on a fresh group with a short timeout, so a rank left
waiting in a collective its peer never joined gets an error, not a hang.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fsdp_lab.model_spec import vocab_size_of
from fsdp_lab.models import synthetic_batch
from fsdp_lab.reference import local_slice
from fsdp_lab.sharding.ties import Tie
from fsdp_lab.tying.lab.config import LAB_MODEL
from fsdp_lab.tying.lab.plans import block_names, build_model, model_sizes, split_tie

SYSTEMS = (
    "fsdp1 use_orig_params=False",
    "fsdp1 use_orig_params=True",
    "fsdp2 fully_shard",
    "fsdp_lab shard",
)
STAGES = ("wrap", "forward", "backward", "step")
COLLECTIVE_TIMEOUT_S = 20  # a rank stuck in a collective its peer left gives up after this


def _wrap(system: str, model: nn.Module, group: dist.ProcessGroup, split: str) -> nn.Module:
    """Wrap `model` so that `split` is a unit of its own, its tied partner in the root."""
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
    from fsdp_lab.sharding.apply import shard

    return shard(model, units=[split], mesh=group)


def _check_tie(model: nn.Module, tie: Tie) -> tuple[bool, bool]:
    """(still_tied, equal_values) of the tie's first and last weights, full, after the step."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    fsdp1 = isinstance(model, FSDP)
    inner = getattr(model, "_fsdp_wrapped_module", model)
    # FSDP1 keeps flat parameters: summon_full_params shows the full tensors for a moment.
    with FSDP.summon_full_params(model, writeback=False) if fsdp1 else contextlib.nullcontext():
        # Attribute by attribute (`inner.tok_emb.weight`), as FSDP1 exposes them: a wrapped
        # submodule forwards the attribute, and summon_full_params sets plain tensors.
        ends = (tie.names[0], tie.names[-1])
        emb, head = (functools.reduce(getattr, n.split("."), inner) for n in ends)
        # FSDP1: plain tensors, tied if they share memory; FSDP2: one DTensor Parameter on both.
        tied = emb is head or (fsdp1 and emb.data_ptr() == head.data_ptr())
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


def default_workload(model_spec: str = LAB_MODEL) -> dict[str, Any]:
    """What the audit trains without the lab's `measure.workloads`: `model_spec` as its
    factory builds it, 2 sequences of 8 tokens per rank, tokens below its own vocab."""
    return {"model": model_spec, "gpt": None, "batch": 2, "seq_len": 8, "vocab": None}


def audit_system(system: str, workload: dict[str, Any], lr: float = 0.5) -> dict:
    """One system's row: wrap the `workload`'s model (`measure.workloads`, `default_workload`)
    invalidly, try one training step, inspect the tie."""
    torch.manual_seed(0)
    model = build_model(workload["model"], workload["gpt"])
    tie, split = split_tie(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    row: dict[str, Any] = {"system": system, "accepted": False, "stage": None, "error": None}
    row.update(still_tied=None, equal_values=None)
    vocab = workload["vocab"] if workload["vocab"] is not None else vocab_size_of(model)
    x, y = synthetic_batch(vocab, workload["batch"] * world, workload["seq_len"], 0)  # (B, T)
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


def audit_worker(
    model_spec: str = LAB_MODEL, workload: dict[str, Any] | None = None
) -> dict[str, Any]:
    """On every rank: `audit_system`'s row for each of `SYSTEMS` (``rows``, the same on every
    rank), and the sizes of the model the rows ran on (``model``, `plans.model_sizes`).

    Args:
        model_spec: "module:factory" of a model with a tie (default TinyGPT).
        workload: the lab's (`measure.workloads`: sizes, batch, sequence length); default
            `default_workload(model_spec)`.
    """
    workload = workload or default_workload(model_spec)
    built = model_sizes(build_model(workload["model"], workload["gpt"]), workload["model"])
    return {"model": built, "rows": [audit_system(system, workload) for system in SYSTEMS]}
