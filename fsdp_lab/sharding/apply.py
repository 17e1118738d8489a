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
                                               into slices of it (`storage.py`; a meta model is
                                               materialised there, unit by unit)
    ShardedUnit(...) for each unit          5. hooks: gather -> compute -> free -> reduce
                                               (`unit.py`), sharing one `ShardingState`

Every refusal (`checks.py`, `mesh.py`, `sharding/wrap.py`) comes before the first collective: a refusal
after it would leave the other ranks waiting in one.

Strategies (`fsdp_lab.theory`; Ψ parameters, N ranks, fp32 Adam):

    "none"       DDP: replicated, gradients all-reduced in buckets       16Ψ per rank
                 while backward runs (`buckets.py`)
    "optimizer"  ZeRO-1: optimizer state sharded, full gradients kept   8Ψ + 8Ψ/N
    "grad_op"    ZeRO-2: gradients sharded as soon as they are ready    4Ψ + 12Ψ/N
    "full"       ZeRO-3: parameters sharded too, gathered per unit      16Ψ/N + largest unit
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab.choices import strategy_named
from fsdp_lab.cluster.where import device as placed_device
from fsdp_lab.sharding import mesh as meshes
from fsdp_lab.sharding.checks import (
    check_bucket_cap,
    check_init_options,
    check_model,
    check_same_plan,
    check_units,
)
from fsdp_lab.sharding.materialize import (
    EMPTY,
    ParamInitFn,
    SliceInit,
    concrete_device,
    reset_parameters,
)
from fsdp_lab.sharding.policy import MixedPrecision, Policies, resolve_policies
from fsdp_lab.sharding.state import ShardingState, attach_state
from fsdp_lab.sharding.steps import ShardingSteps
from fsdp_lab.sharding.storage import StorageBuilder, build_storage, expose_flat_parameter
from fsdp_lab.sharding.unit import ShardedUnit
from fsdp_lab.sharding.wrap import Units, build_plan, without_params
from fsdp_lab.tying.ties import record_ties, recorded_ties


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
            25 MiB); 0 reduces each unit once, after its backward. See `buckets.py`.
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
