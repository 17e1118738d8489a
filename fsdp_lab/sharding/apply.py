"""`shard(model, ...)`: turn a model into FSDP/ZeRO units, in place — the lifecycle in order.

    policy  = strategy_named(strategy)      1. the strategy, resolved once and carried as one
                                               object (`choices.Strategy`) from here on
    groups  = resolve(mesh, policy)         2. the process groups (`mesh.py`): every rank, or
                                               a (replicate, shard) mesh for HSDP
    plan    = build_plan(model, units)      3. which modules are gathered together (validated:
                                               ties inside one unit), less `ignored_params`,
                                               and what each unit does (`policy.py`: the
                                               model's defaults or the unit's own policy) —
                                               before any message
    storage = build_storage(...)            4. each unit's flat shard, its parameters turned
                                               into slices of it (`flat_param.py`; a meta model is
                                               materialised there, unit by unit)
    ShardedUnit(...) for each unit          5. hooks: gather -> compute -> free -> reduce
                                               (`unit.py`), sharing one `ShardingState`

Every refusal (below, `mesh.py`, `wrap.py`) comes before the first collective: a refusal
after it would leave the other ranks waiting in one.

Strategies (`fsdp_lab.theory`; Ψ parameters, N ranks, fp32 Adam):

    "none"       DDP: replicated, gradients all-reduced in buckets       16Ψ per rank
                 while backward runs (`policy.py`)
    "optimizer"  ZeRO-1: optimizer state sharded, full gradients kept   8Ψ + 8Ψ/N
    "grad_op"    ZeRO-2: gradients sharded as soon as they are ready    4Ψ + 12Ψ/N
    "full"       ZeRO-3: parameters sharded too, gathered per unit      16Ψ/N + largest unit
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab.choices import strategy_named
from fsdp_lab.cluster.where import device as placed_device
from fsdp_lab.sharding import mesh as meshes
from fsdp_lab.sharding.flat_param import StorageBuilder, build_storage, expose_flat_parameter
from fsdp_lab.sharding.materialize import (
    EMPTY,
    ParamInitFn,
    SliceInit,
    concrete_device,
    reset_parameters,
)
from fsdp_lab.sharding.policy import MixedPrecision, Policies, resolve_policies
from fsdp_lab.sharding.state import ShardingState, attach_state, sharded_root, sharding_state
from fsdp_lab.sharding.steps import ShardingSteps
from fsdp_lab.sharding.ties import find_ties, record_ties, recorded_ties, verify_weight_tying
from fsdp_lab.sharding.unit import ShardedUnit
from fsdp_lab.sharding.wrap import Units, build_plan, without_params

# --------------------------------------------------------------------------------------------
# What `shard` refuses, and why — checked on every rank before any message is sent.
#
# A refusal after the first collective would leave the other ranks waiting in one; so every
# check here reads only this rank's model, which every rank built the same way.


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
            "fsdp_lab.sharding.ties.retie(model, fsdp_lab.sharding.ties.recorded_ties(model)) before shard()."
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


def _target_device(device: torch.device | str | None) -> torch.device:
    """Where a meta model's shards go: `device`, else where this rank computes."""
    if device is None:  # where this rank computes: its GPU, a shared GPU, or the CPU
        device = placed_device() if dist.is_initialized() else "cpu"
    return concrete_device(device)


def shard(
    model: nn.Module,
    units: Units = None,
    strategy: str = "full",
    prefetch: bool = True,
    mixed_precision: MixedPrecision | None = None,
    mesh: Any = None,
    reshard_after_forward: bool | Iterable[str] | None = None,
    *,
    device: torch.device | str | None = None,
    param_init_fn: ParamInitFn | str | None = None,
    shard_init: SliceInit | None = None,
    sync_module_states: bool = False,
    use_orig_params: bool = True,
    policies: Policies = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
    offload: bool = False,
    bucket_cap_mb: float = 25.0,
    steps: ShardingSteps = ShardingSteps(),  # noqa: B008 (frozen: one shared default is safe)
) -> nn.Module:
    """Shard `model` in place (FSDP/ZeRO) and return it.

    Args:
        model: identical on every rank (same init); parameters on one device.
        units: the wrap plan: module classes, module names, a policy callable, `MinParams`.
            Everything not claimed is the root unit. Ties must stay inside one unit.
        strategy: "none" (DDP), "optimizer" (ZeRO-1), "grad_op" (ZeRO-2), "full" (ZeRO-3);
            on a 2-D mesh "hybrid" (ZeRO-3 inside each shard group, HSDP) or "hybrid_zero2".
        prefetch: start the next unit's all-gather while the current one computes.
        mixed_precision: compute dtype and gradient-reduction dtype; None for fp32 throughout.
        mesh: None (all ranks), a 1-D DeviceMesh or a ProcessGroup spanning every rank; for
            the hybrid strategies (R, S) — R replicas of S-rank shard groups, R·S ranks — or a
            2-D (replicate, shard) DeviceMesh. See [Note: the 2-D mesh] in `sharding.mesh`.
        reshard_after_forward: "full"/"hybrid" only — which units are freed after forward and
            gathered again for backward. None (default) or True: every unit but the root, as
            FSDP2's default (None) and FSDP1 do — the root's backward comes right after the
            forward, so freeing it would only buy one all-gather more per step; see [Note: the
            root stays gathered]. (FSDP2's explicit True frees the root too: here, the list of
            every unit.) False: none. Or the unit names to free (the root's, "", included).
        device: a meta model: where its shards go; offload: where the units compute (default:
            where this rank computes, `fsdp_lab.cluster.device()`: its own GPU, a shared GPU, or
            the CPU).
        param_init_fn: a meta model only: called on every module, children before parents
            (default: its ``reset_parameters()``); see [Note: init order] in
            `fsdp_lab.sharding.materialize`. ``"empty"``: allocate the shards only (NaN), and
            initialise afterwards with ``with full_init(model): model.init_weights()``.
        shard_init: a meta model only: fills each rank's shard directly from a counter-based
            init (`fsdp_lab.meta_init.counter_init.DeterministicInit`), without materialising any unit.
        sync_module_states: rank 0's values are broadcast to every rank before sharding (on a
            meta model, only rank 0 runs `param_init_fn`). Always on for "none", as DDP does.
        use_orig_params: True (default, FSDP2's behaviour): every parameter keeps its name, as
            this rank's slice of it (its full shape under "none"); frozen parameters stay
            frozen and a parameter without a gradient keeps ``grad=None``. False: one flat
            parameter per unit, ``flat_param`` (FSDP1's default; the sharding lab draws it).
            See [Note: per-parameter views] in `fsdp_lab.sharding.unit`.
        policies: per unit, what differs from the defaults above: {unit name or module class:
            `UnitPolicy(strategy=, reshard_after_forward=, mixed_precision=, offload=)`}, e.g.
            ``{"": UnitPolicy(strategy="replicate")}`` keeps the root's norms whole on every
            rank. See [Note: policies as one mapping] in `fsdp_lab.sharding.policy`.
        ignored_params: parameters left alone (FSDP2's meaning): not sharded, not moved, their
            gradients not reduced — whole on every rank, the caller's to synchronise.
        offload: keep every unit's shard, gradient and optimizer state in host memory (a
            `UnitPolicy` can choose per unit); the parameters visit the compute device, which is
            `device` (default: where the model's parameters are). See `fsdp_lab.sharding.unit`.
        bucket_cap_mb: replicated units ("none"/"replicate", per-parameter views, fp32): their
            gradients are all-reduced in buckets of this size while backward still runs (DDP's
            25 MiB); 0 reduces each unit once, after its backward. See `policy.py`.
        steps: the steps every unit calls (`fsdp_lab.sharding.steps`): the reference by
            default; a course exercise passes a learner's function in one field.
    """
    policy = strategy_named(strategy)  # 1
    check_model(model, dist.get_backend() if dist.is_initialized() else None)
    check_init_options(model, param_init_fn, shard_init, sync_module_states)
    check_bucket_cap(bucket_cap_mb)
    groups = meshes.resolve(mesh, policy)  # 2: every mesh error before any message
    plan = without_params(build_plan(model, units), model, ignored_params)  # 3: before any message
    check_units(model, plan, use_orig_params)
    unit_plans = resolve_policies(  # what each unit does: the defaults, or its own policy
        model, plan, policy, policies, mixed_precision, reshard_after_forward, offload
    )
    settings = f"{policy.name} {prefetch} {use_orig_params} {bucket_cap_mb} {offload}"
    check_same_plan(model, plan, unit_plans, settings, groups)  # the first message

    on_meta = next(model.parameters()).is_meta  # one device: check_model made sure
    if on_meta and not recorded_ties(model):
        record_ties(model)  # identity ties are visible on meta: keep them for verification
    builder = StorageBuilder(
        model=model,
        plan=plan,
        unit_plans=unit_plans,
        shard_rank=groups.shard_rank,
        shard_size=groups.shard_size,
        device=_target_device(device) if on_meta else None,
        compute_device=concrete_device(device) if device is not None and not on_meta else None,
        fill_nan=param_init_fn == EMPTY,
        template=next(model.parameters()),
    )
    storage = build_storage(  # 4
        builder,
        init_fn=param_init_fn or reset_parameters,
        shard_init=shard_init,
        sync_group=groups.sync_group,
        # DDP: every replica starts from rank 0's values
        sync=sync_module_states or (not policy.sharded and shard_init is None),
    )
    state = ShardingState(groups=groups, prefetch=prefetch, strategy=policy, steps=steps)
    for name, unit_storage in storage.items():  # 5: root first, as the hooks expect
        modules = [model.get_submodule(m) for m in plan.members_of(name)]
        if not use_orig_params:  # FSDP1: the optimizer sees one flat parameter per unit
            expose_flat_parameter(modules[0], unit_storage)
        unit = ShardedUnit(
            name=name,
            modules=modules,
            flat=unit_storage.flat,
            owners=unit_storage.owners,
            aliases=unit_storage.aliases,
            plan=unit_plans[name],
            state=state,
            params=unit_storage.params if use_orig_params else None,
            frozen=unit_storage.frozen,
            bucket_bytes=int(bucket_cap_mb * 2**20),
        )
        state.units.append(unit)
    attach_state(model, state)
    return model
