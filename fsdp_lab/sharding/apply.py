"""`shard(model, ...)`: turn a model into FSDP/ZeRO units, in place — the lifecycle in order.

    policy  = strategy_named(strategy)      1. the strategy, resolved once and carried as one
                                               object (`choices.Strategy`) from here on
    groups  = resolve(mesh, policy)         2. the process groups (`mesh.py`): every rank, or
                                               a (replicate, shard) mesh for HSDP
    plan    = build_plan(model, units)      3. which modules are gathered together (validated:
                                               ties inside one unit) — before any message
    storage = build_storage(...)            4. each unit's flat shard, its parameters turned
                                               into slices of it (`storage.py`; a meta model is
                                               materialised there, unit by unit)
    ShardedUnit(...) for each unit          5. hooks: gather -> compute -> free -> reduce
                                               (`unit.py`), sharing one `ShardingState`

Every refusal (`checks.py`, `mesh.py`, `sharding/wrap.py`) comes before the first collective: a refusal
after it would leave the other ranks waiting in one.

Strategies (`fsdp_lab.theory`; Ψ parameters, N ranks, fp32 Adam):

    "none"       DDP: replicated, gradients all-reduced                  16Ψ per rank
    "optimizer"  ZeRO-1: optimizer state sharded, full gradients kept   8Ψ + 8Ψ/N
    "grad_op"    ZeRO-2: gradients sharded as soon as they are ready    4Ψ + 12Ψ/N
    "full"       ZeRO-3: parameters sharded too, gathered per unit      16Ψ/N + largest unit
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab.choices import Strategy, strategy_named
from fsdp_lab.sharding import mesh as meshes
from fsdp_lab.sharding.checks import check_init_options, check_model, check_units
from fsdp_lab.sharding.materialize import (
    EMPTY,
    ParamInitFn,
    SliceInit,
    concrete_device,
    reset_parameters,
)
from fsdp_lab.sharding.state import ShardingState, attach_state
from fsdp_lab.sharding.steps import ShardingSteps
from fsdp_lab.sharding.storage import StorageBuilder, build_storage
from fsdp_lab.sharding.unit import ShardedUnit
from fsdp_lab.sharding.wrap import Units, build_plan
from fsdp_lab.tying.ties import record_ties, recorded_ties

FLAT_PARAM = "flat_param"  # attribute of each unit module holding its shard


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in `param_dtype` (all-gathered in it); reduce gradients in `reduce_dtype`.

    The shards, their gradients and the optimizer stay in the parameters' dtype (fp32).
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = torch.float32


def _target_device(device: torch.device | str | None) -> torch.device:
    """Where a meta model's shards go: `device`, else this rank's GPU under NCCL, else CPU."""
    if device is None:
        device = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return concrete_device(device)


def _freed_after_forward(
    units: list[str], policy: Strategy, asked: bool | Iterable[str] | None
) -> set[str]:
    """The units freed after forward. [Note: the root stays gathered] The root unit is the
    first to be gathered in forward and, holding the loss-side modules (a GPT's head), the
    first needed in backward: freeing it between the two passes and gathering it again costs
    one all-gather of the root per step and saves its bytes only for the instant between
    forward and backward. FSDP2 (`FSDPState._lazy_init`: the root's post-forward mesh is
    None) and FSDP1 (`_post_forward_reshard` skips the root) both keep it; so do we by
    default. notebooks/01_sharding.ipynb measures both choices."""
    if not policy.reshard_after_forward or asked is False:
        return set()
    if asked is None or asked is True:
        return set(units[1:])  # units[0] is the root
    free_after = set(asked)
    unknown = free_after - set(units)
    if unknown:
        raise ValueError(
            f"reshard_after_forward names unknown units {sorted(unknown)}: expected some of "
            f"{units} (the root is ''). Fix: use the names `build_plan` gives, or True/False"
        )
    return free_after


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
            gathered again for backward. None or True (default): every unit but the root, as
            FSDP2 and FSDP1 do — the root's backward comes right after the forward, so freeing
            it would only buy one all-gather more per step; see [Note: the root stays
            gathered]. False: none. Or the unit names to free (the root's name, "", included).
        device: a meta model only: where its shards go (default: this rank's GPU under NCCL,
            else CPU).
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
        steps: the steps every unit calls (`fsdp_lab.sharding.steps`): the reference by
            default; a course exercise passes a learner's function in one field.
    """
    policy = strategy_named(strategy)  # 1
    check_model(model, dist.get_backend() if dist.is_initialized() else None)
    check_init_options(model, param_init_fn, shard_init, sync_module_states)
    groups = meshes.resolve(mesh, policy)  # 2: every mesh error before any message
    plan = build_plan(model, units)  # 3: every plan error before any collective
    check_units(model, plan, use_orig_params)
    free_after = _freed_after_forward(plan.units, policy, reshard_after_forward)

    on_meta = next(model.parameters()).is_meta  # one device: check_model made sure
    if on_meta and not recorded_ties(model):
        record_ties(model)  # identity ties are visible on meta: keep them for verification
    builder = StorageBuilder(
        model=model,
        plan=plan,
        shard_rank=groups.shard_rank if policy.sharded else 0,
        shard_size=groups.shard_size if policy.sharded else 1,
        compute_dtype=mixed_precision.param_dtype if mixed_precision else None,
        device=_target_device(device) if on_meta else None,
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
            for owners in unit_storage.owners:
                for module, attr in owners:
                    del module._parameters[attr]  # from now on a view, set by the unit
            modules[0].register_parameter(FLAT_PARAM, unit_storage.flat.shard)
        unit = ShardedUnit(
            name=name,
            modules=modules,
            flat=unit_storage.flat,
            owners=unit_storage.owners,
            aliases=unit_storage.aliases,
            strategy=policy,
            state=state,
            reshard_after_forward=name in free_after,
            reduce_dtype=mixed_precision.reduce_dtype if mixed_precision else None,
            params=unit_storage.params if use_orig_params else None,
            frozen=unit_storage.frozen,
        )
        state.units.append(unit)
    attach_state(model, state)
    return model
