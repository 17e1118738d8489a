"""What `shard` refuses, and why — checked on every rank before any message is sent.

A refusal after the first collective would leave the other ranks waiting in one; so every
check here reads only this rank's model, which every rank built the same way.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from fsdp_lab.sharding.state import sharded_root, sharding_state
from fsdp_lab.tying.ties import find_ties, recorded_ties, verify_weight_tying


def check_model(model: nn.Module, backend: str | None = None) -> None:
    """Refuse what cannot be sharded — a model (or part of one) sharded already, storage ties, broken recorded ties, parameters on several devices, or on the CPU
    under NCCL (`backend`, the process group's) — each with the fix, before any rank sends a
    message."""
    if sharding_state(model, required=False) is not None:
        raise ValueError("this model is already sharded; shard() applies once per model")
    for name, module in model.named_modules():
        root = sharded_root(module)
        if root is not None or sharding_state(module, required=False) is not None:
            inside = f"its submodule {name!r}" if name else "this module"
            whole = type(root).__name__ if root is not None else type(module).__name__
            raise ValueError(
                f"{inside} is part of a {whole} that fsdp_lab.shard already sharded: its "
                "parameters are views into that model's flat shards, and sharding them again "
                "would shard slices of slices. Fix: shard the whole model once, naming the "
                f"units you want, e.g. shard(model, units={{{type(module).__name__}}})"
            )
    params = list(model.named_parameters())
    if not params:
        raise ValueError("the model has no parameters: there is nothing to shard")

    views = [t for t in find_ties(model) if t.kind == "storage"]
    if views:
        # Each Parameter becomes its own flat segment: two Parameters viewing one storage would
        # get two copies, trained apart. Only one Parameter under several names stays one copy.
        raise ValueError(
            f"parameters {list(views[0].names)} are distinct Parameters sharing one storage "
            "(a storage tie); shard() keeps one copy per Parameter object, so they would drift "
            "apart. Fix: register the same nn.Parameter under both names (an identity tie), "
            "e.g. `model.head.weight = model.tok_emb.weight`."
        )
    ties = recorded_ties(model)
    broken = verify_weight_tying(model, ties) if ties else []
    if broken:
        raise ValueError(
            "the model's recorded weight ties are broken (materialising from meta with "
            "to_empty unties them): " + "; ".join(broken) + ". Fix: "
            "fsdp_lab.tying.ties.retie(model, fsdp_lab.tying.ties.recorded_ties(model)) before shard()."
        )
    devices = {p.device for _, p in params}
    if len(devices) > 1:
        where = {str(d): next(n for n, p in params if p.device == d) for d in devices}
        raise ValueError(
            f"the model's parameters are on several devices, e.g. {where}: shard() takes a model "
            "on one device (or entirely on meta, to materialise shard by shard). Fix: "
            "model.to(device) — or build the whole model under torch.device('meta')"
        )
    (device,) = devices
    if backend == "nccl" and device.type == "cpu":
        # NCCL moves GPU memory only: the first collective on a CPU shard fails deep inside
        # backward ("No backend type associated with device type cpu"), not here.
        raise ValueError(
            f"the model's parameters are on the CPU (e.g. {params[0][0]!r}) but the process "
            "group is NCCL, which moves GPU memory only. Fix: model.to(fsdp_lab.cluster.device()) "
            "before shard(), or build it on the meta device, or use backend='gloo'"
        )


def check_units(model: nn.Module, plan: Any, use_orig_params: bool) -> None:
    """One dtype per unit (one flat buffer); one `requires_grad` per unit for the flat view."""
    for unit in plan.units:
        named = [(r.name, model.get_parameter(r.name)) for r in plan.params[unit]]
        dtypes = {p.dtype for _, p in named}
        where = "the root unit" if unit == "" else f"unit {unit!r}"
        if len(dtypes) > 1:
            first = {d: next(n for n, p in named if p.dtype == d) for d in dtypes}
            shown = ", ".join(f"{n!r} is {d}" for d, n in first.items())
            raise ValueError(
                f"{where} mixes parameter dtypes: {shown}. A unit is one flat buffer of one "
                "dtype (fully_shard refuses this too). Fix: model.to(one_dtype) and "
                "mixed_precision=MixedPrecision(...) for compute, or put the parameters of each "
                "dtype in their own unit (units=[...])"
            )
        frozen = {p.requires_grad for _, p in named}
        if not use_orig_params and len(frozen) > 1:
            stiff = [n for n, p in named if not p.requires_grad]
            raise ValueError(
                f"{where} mixes frozen and trainable parameters (frozen: {stiff[:3]}"
                f"{' ...' if len(stiff) > 3 else ''}), and with use_orig_params=False the unit "
                "is one flat parameter with one requires_grad (FSDP1 refuses this too). Fix: "
                "use_orig_params=True (the default), or put the frozen modules in their own unit"
            )


def check_init_options(
    model: nn.Module, param_init_fn: Any, shard_init: Any, sync_module_states: bool
) -> None:
    """The meta-init options only where they mean something."""
    device = next(model.parameters()).device  # one device: check_model made sure
    if device.type != "meta" and (param_init_fn is not None or shard_init is not None):
        what = "param_init_fn" if param_init_fn is not None else "shard_init"
        raise ValueError(
            f"{what} initialises a model built on the meta device, but this model's parameters "
            f"are on {device}. Fix: drop {what}, or build the model under torch.device('meta')"
        )
    if shard_init is not None and sync_module_states:
        raise ValueError(
            "shard_init and sync_module_states=True both make ranks agree; pick one "
            "(shard_init needs no communication)"
        )


def check_bucket_cap(bucket_cap_mb: Any) -> None:
    """DDP's bucket size: a number of MiB >= 0 (0: one all-reduce per unit, after backward)."""
    ok = isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool)
    if not ok or not math.isfinite(bucket_cap_mb) or bucket_cap_mb < 0:
        raise ValueError(
            f"bucket_cap_mb={bucket_cap_mb!r}: expected a number of MiB >= 0 (DDP's default is "
            "25; 0 sends each unit's gradient once, after its backward). Fix: bucket_cap_mb=25"
        )


def plan_lines(model: nn.Module, plan: Any, unit_plans: dict[str, Any], settings: str) -> list[str]:
    """This rank's plan as lines of text, the model-wide settings first (strategy, prefetch,
    use_orig_params, bucket_cap_mb, offload), then one per unit: its modules, its parameters'
    shapes and dtypes, and what its policy resolved to."""
    lines = [f"shard(strategy, prefetch, use_orig_params, bucket_cap_mb, offload) = {settings}"]
    for name, unit in unit_plans.items():
        members = plan.members_of(name)
        params = [
            (f"{m}.{n}".strip("."), tuple(p.shape), str(p.dtype).removeprefix("torch."))
            for m in members
            for n, p in model.get_submodule(m).named_parameters()
        ]
        precision = unit.mixed_precision
        dtypes = (precision.param_dtype, precision.reduce_dtype) if precision else None
        lines.append(
            f"unit {name!r}: strategy={unit.strategy.name} "
            f"reshard_after_forward={unit.reshard_after_forward} mixed_precision={dtypes} "
            f"offload={unit.offload} modules={members} parameters={params}"
        )
    return lines


def check_same_plan(
    model: nn.Module, plan: Any, unit_plans: dict[str, Any], settings: str, groups: Any
) -> None:
    """Refuse, on every rank of the model's mesh (`groups`), a plan (`plan_lines`) that differs
    between them, naming the first difference. Ranks that disagree would send messages of
    different sizes (or to different groups) in the first collective, where gloo aborts the
    process and NCCL hangs. One process, or fake ranks: nothing to compare, nothing built.

    A check, not the mechanism: its two small messages (a digest; the plans only when digests
    differ) bypass `fsdp_lab.comm`, so every lab's counted bytes stay the mechanism's.
    """
    group = groups.group if groups.replicate_group is None else None  # None: every rank
    if not dist.is_initialized() or dist.get_backend(group) == "fake":
        return
    if dist.get_world_size(group) == 1:
        return
    lines = plan_lines(model, plan, unit_plans, settings)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    digests: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return
    plans: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(plans, lines, group=group)
    first = next(r for r, d in enumerate(digests) if d != digests[0])
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(plans))
    theirs, ours = plans[first], plans[0]
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
             min(len(ours), len(theirs)))  # fmt: skip
    said = [p[k][:400] if k < len(p) else "(no such line)" for p in (ours, theirs)]
    raise ValueError(
        f"shard(): the ranks were given different plans — rank {list(ranks)[0]}: {said[0]}; "
        f"rank {list(ranks)[first]}: {said[1]}. Every rank must call shard() with the same "
        "model, units, strategy and policies (a policy chosen by rank() differs between ranks)"
    )
