"""Parity: one model, one optimizer recipe, one data stream, trained under any system — ours or
PyTorch's — and returned as full parameters by name, so two runs compare element by element.

Systems (strings, so they travel to the ranks and print as they are):

    single                     one process, the whole global batch         (the ground truth)
    ours:<strategy>            fsdp_lab.shard(model, units, strategy)       none/optimizer/grad_op/full
    fsdp2:reshard              fully_shard, reshard_after_forward=True      ZeRO-3
    fsdp2:keep                 fully_shard, reshard_after_forward=False     ZeRO-2's memory shape
    fsdp2:replicate            fully_shard on an (N, 1) replicate x shard mesh: HSDP with shard
                               groups of one rank, i.e. plain replication (DDP's maths)
    fsdp1:<ShardingStrategy>   FullyShardedDataParallel(use_orig_params=True), FULL_SHARD /
                               SHARD_GRAD_OP / NO_SHARD
    ddp                        DistributedDataParallel
    ddp+zero                   DDP with ZeroRedundancyOptimizer (ZeRO-1: optimizer state sharded)

`COUNTERPARTS` pairs each of our strategies with PyTorch's nearest configuration of each
system (None where PyTorch has none: FSDP1 has no ZeRO-1). Every path builds the same model
(seeded), takes its contiguous slice of the same global batch and trains with the same
optimizer recipe; CPU and gloo only.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab import reference
from fsdp_lab.cluster import intra_op_threads
from fsdp_lab.parity_models import PARITY_MODELS, TITAN_INIT_SEED, ParityModel, unit_names

COUNTERPARTS: dict[str, dict[str, str | None]] = {  # our strategy -> column -> system
    "none": {"fully_shard": "fsdp2:replicate", "FSDP1": "fsdp1:NO_SHARD", "DDP": "ddp"},
    "optimizer": {"fully_shard": "fsdp2:keep", "FSDP1": None, "DDP": "ddp+zero"},
    "grad_op": {"fully_shard": "fsdp2:keep", "FSDP1": "fsdp1:SHARD_GRAD_OP", "DDP": None},
    "full": {"fully_shard": "fsdp2:reshard", "FSDP1": "fsdp1:FULL_SHARD", "DDP": None},
}
NO_DECAY_MODULES = (nn.LayerNorm, nn.RMSNorm, nn.BatchNorm1d)

# Max |difference| two correct fp32 runs may show after a few steps. Summing a batch's
# gradient in another order (one process, or N ranks' partial sums all-reduced) changes each
# element by a few ulps of the terms summed (fp32: 2^-24 ~ 6e-8 relative). SGD carries that
# into the parameters as lr x that error per step: far below 1e-6. AdamW divides each element by
# its own running size, so its step changes by lr x the element's *relative* error: small,
# unless the terms nearly cancel (an RMSNorm weight of TTTransformer, where DDP and fully_shard
# sit as far from single process as ours) or cancel exactly ([Note: Adam and a zero gradient] in
# `fsdp_lab.parity_models`: those models train with SGD). Parameters are O(1) here (an embedding
# drawn with std 1 reaches 3-4, where one ulp is 2.4e-7 to 4.8e-7): 1e-6 is a few ulps. A
# mechanism error — a lost or doubled gradient, a wrong slice, a decayed frozen weight — moves
# parameters by about lr x gradient (1e-4 to 1e-2 here), orders of magnitude above it.
FP32_TOLERANCE = 1e-6


def train(
    model_name: str, system: str, steps: int, optimizer: str | None = None
) -> dict[str, torch.Tensor]:
    """Train `model_name` under `system` for `steps` steps; every parameter, full size, by name.

    Runs on every rank of a cluster (`cluster.run(train, ...)`), or in one process for
    "single". One intra-op thread: N ranks share the machine's cores. `optimizer` overrides
    the model's recipe ("sgd" or "adamw").
    """
    spec = PARITY_MODELS[model_name]
    single = system == "single"
    rank = 0 if single else dist.get_rank()
    world = 1 if single else dist.get_world_size()
    with intra_op_threads(1), warnings.catch_warnings():
        # Known and beside the point here: FSDP1's NO_SHARD is deprecated (in favour of DDP);
        # nn.Transformer's encoder skips nested tensors when its layers are not batch-first.
        warnings.filterwarnings("ignore", message=".*NO_SHARD.*deprecated", category=FutureWarning)
        warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
        model = wrap(spec, system)
        opt = make_optimizer(optimizer or spec.optimizer, model, zero=system == "ddp+zero")
        for step in range(steps):
            inputs, target = spec.batch(step)
            mine = [_local(t, spec.batch_dim, rank, world) for t in inputs]
            loss = spec.loss(model(*mine), _local(target, spec.batch_dim, rank, world))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return reference.full_parameters(model)


def _local(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return reference.local_slice(t.movedim(dim, 0), rank, world).movedim(0, dim)


def wrap(spec: ParityModel, system: str) -> nn.Module:
    """The model of `spec`, built and wrapped by `system` with the spec's units."""
    kind, _, option = system.partition(":")
    if kind == "ours":
        return _ours(spec, option)
    model = spec.build()
    names = unit_names(model, spec.units)
    if kind == "single":
        return model
    if kind == "fsdp2":
        return _fully_shard(model, names, option)
    if kind == "fsdp1":
        return _fsdp1(model, names, option)
    if kind in ("ddp", "ddp+zero"):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, find_unused_parameters=spec.unused_parameters)
    raise ValueError(f"system={system!r}: not one of single, ours:*, fsdp2:*, fsdp1:*, ddp")


def _ours(spec: ParityModel, strategy: str) -> nn.Module:
    from fsdp_lab.sharding import full_init, shard

    if spec.meta_factory is None:
        model = spec.build()
        return shard(model, units=unit_names(model, spec.units), strategy=strategy)
    # torchtitan's pattern: shard the meta model (shards allocated, not initialised), then the
    # model's own init_weights() on the sharded model — each rank keeps its slice.
    with torch.device("meta"):
        model = spec.meta_factory()
    names = unit_names(model, spec.units)
    shard(model, units=names, strategy=strategy, param_init_fn="empty")
    torch.manual_seed(TITAN_INIT_SEED)
    with full_init(model):
        model.init_weights()
    return model


def _fully_shard(model: nn.Module, names: list[str], option: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if option == "replicate":
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    elif option in ("reshard", "keep"):
        mesh = init_device_mesh("cpu", (world,))
    else:
        raise ValueError(f"fsdp2:{option}: expected reshard, keep or replicate")
    reshard = option == "reshard"
    for name in names:  # inner units first, as fully_shard requires
        fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=reshard)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


def _fsdp1(model: nn.Module, names: list[str], option: str) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    units = {model.get_submodule(n) for n in names}
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=units.__contains__),
        sharding_strategy=ShardingStrategy[option],
        use_orig_params=True,
        device_id=torch.device("cpu"),
    )


def no_decay_parameters(model: nn.Module) -> set[int]:
    """ids of biases and norm weights — found by module and attribute, never by `p.ndim` (a
    sharded view is 1-D whatever its parameter's shape)."""
    found = set()
    for module in model.modules():
        for attr, p in module.named_parameters(recurse=False):
            if attr.endswith("bias") or isinstance(module, NO_DECAY_MODULES):
                found.add(id(p))
    return found


def make_optimizer(recipe: str, model: nn.Module, zero: bool = False) -> torch.optim.Optimizer:
    """The recipe of the parity table, built on the wrapped model's parameters (every one of
    them, frozen ones too: an optimizer must skip a parameter whose grad is None)."""
    params = list(model.parameters())
    if recipe == "sgd":
        groups = [{"params": params}]
        cls, kwargs = torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2}
    elif recipe == "adamw":
        skip = no_decay_parameters(model)
        groups = [
            {"params": [p for p in params if id(p) not in skip], "weight_decay": 0.1},
            {"params": [p for p in params if id(p) in skip], "weight_decay": 0.0},
        ]
        cls, kwargs = torch.optim.AdamW, {"lr": 1e-2}
    else:
        raise ValueError(f"optimizer recipe {recipe!r}: expected 'sgd' or 'adamw'")
    groups = [g for g in groups if g["params"]]
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **kwargs)
    return cls(groups, **kwargs)
