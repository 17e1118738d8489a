"""Parity: one model, one optimizer recipe, one data stream, trained under any system — ours or
PyTorch's — and returned as full parameters by name, so two runs compare element by element.

Systems are `fsdp_lab.reference.SYSTEMS`, the one table every comparison wraps through: ours
per strategy, single process, fully_shard (FSDP2), FSDP1, DDP, DDP + ZeroRedundancyOptimizer.

`COUNTERPARTS` pairs each of our strategies with PyTorch's nearest configuration of each
system (None where PyTorch has none: FSDP1 has no ZeRO-1). Every path builds the same model
(seeded), takes its contiguous slice of the same global batch and trains with the same
optimizer recipe; CPU and gloo only.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from parity_models import PARITY_MODELS, TITAN_INIT_SEED, ParityModel

from fsdp_lab import reference
from fsdp_lab.cluster import intra_op_threads

COUNTERPARTS: dict[str, dict[str, str | None]] = {  # our strategy -> column -> system
    "none": {"fully_shard": "fully_shard:replicate", "FSDP1": "fsdp1:NO_SHARD", "DDP": "ddp"},
    "optimizer": {"fully_shard": "fully_shard:keep", "FSDP1": None, "DDP": "ddp+zero"},
    "grad_op": {"fully_shard": "fully_shard:keep", "FSDP1": "fsdp1:SHARD_GRAD_OP", "DDP": None},
    "full": {"fully_shard": "fully_shard", "FSDP1": "fsdp1", "DDP": None},
}
NO_DECAY_MODULES = (nn.LayerNorm, nn.RMSNorm, nn.BatchNorm1d)

# Max |difference| two correct fp32 runs may show after a few steps. Summing a batch's
# gradient in another order (one process, or N ranks' partial sums all-reduced) changes each
# element by a few ulps of the terms summed (fp32: 2^-24 ~ 6e-8 relative). SGD carries that
# into the parameters as lr x that error per step: far below 1e-6. AdamW divides each element by
# its own running size, so its step changes by lr x the element's *relative* error: small,
# unless the terms nearly cancel (an RMSNorm weight of TTTransformer, where DDP and fully_shard
# sit as far from single process as ours) or cancel exactly ([Note: Adam and a zero gradient] in
# `parity_models.py`: those models train with SGD). Parameters are O(1) here (an embedding
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
        opt = make_optimizer(optimizer or spec.optimizer, model, system)
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
    """The model of `spec`, built and wrapped by `system` (`reference.SYSTEMS`) with its units."""
    if system.startswith("ours:") and spec.meta_factory is not None:
        return _ours_on_meta(spec, system.removeprefix("ours:"))
    units = () if system in (*reference.ONE_UNIT, "single") else spec.units
    ddp = {"find_unused_parameters": spec.unused_parameters} if system.startswith("ddp") else {}
    return reference.wrap(spec.build(), system, units, **ddp)


def _ours_on_meta(spec: ParityModel, strategy: str) -> nn.Module:
    """torchtitan's pattern: shard the meta model (shards allocated, not initialised), then the
    model's own init_weights() on the sharded model — each rank keeps its slice."""
    from fsdp_lab.sharding import full_init, shard

    with torch.device("meta"):
        model = spec.meta_factory()
    shard(model, units=spec.units, strategy=strategy, param_init_fn="empty")
    torch.manual_seed(TITAN_INIT_SEED)
    with full_init(model):
        model.init_weights()
    return model


def no_decay_parameters(model: nn.Module) -> set[int]:
    """ids of biases and norm weights — found by module and attribute, never by `p.ndim` (a
    sharded view is 1-D whatever its parameter's shape)."""
    found = set()
    for module in model.modules():
        for attr, p in module.named_parameters(recurse=False):
            if attr.endswith("bias") or isinstance(module, NO_DECAY_MODULES):
                found.add(id(p))
    return found


def make_optimizer(recipe: str, model: nn.Module, system: str = "single") -> torch.optim.Optimizer:
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
    return reference.make_optimizer(system, [g for g in groups if g["params"]], cls, **kwargs)
