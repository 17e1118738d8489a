"""Lab 01, on the ranks: the same model and data trained by ours, FSDP2, DDP + ShardedOptimizer,
PyTorch's ZeroRedundancyOptimizer, and one process on the whole batch.

Every run starts from the factory's weights and draws the same batches (`reference.train_steps`),
so their parameters can be compared element by element afterwards (`analysis.py`). Our run is
measured as it trains: bytes per collective by `fsdp_lab.comm`, memory by
`fsdp_lab.trace.MemoryTracker`, compute and communication spans by `Timeline`.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import torch

from fsdp_lab import comm, reference
from fsdp_lab.cluster import (
    AttachedCluster,
    Cluster,
    borrow,
    device,
    in_rank_threads,
    rank,
    world_size,
)
from fsdp_lab.model_spec import check_on_rank0, load_factory
from fsdp_lab.sharding import ShardedOptimizer, sharding_state
from fsdp_lab.sharding.flat_param import FlatParameter
from fsdp_lab.sharding.lab.config import ShardConfig, check_batch_divides
from fsdp_lab.sharding.policy import UnitPolicy
from fsdp_lab.sharding.wrap import ROOT, build_plan
from fsdp_lab.trace import MemoryTracker, Timeline


def flat_layout(flat: FlatParameter) -> dict[str, int]:
    """A flat parameter's sizes: elements real, padded to a multiple of N, per shard; bytes
    per element. What `theory.sharding_step` needs of each unit."""
    return {
        "numel": flat.numel,
        "padded_numel": flat.padded_numel,
        "shard_numel": flat.shard_numel,
        "element_size": flat.shard.element_size(),
    }


def unit_layout(unit: Any) -> dict[str, Any]:
    """A wrap unit as `theory.sharding_step` reads it: its name, `flat_layout`, and whether it
    is freed after forward (gathered again for backward) or kept, as the root is by default."""
    own = {"strategy": unit.strategy.name} if unit.strategy is not unit.state.strategy else {}
    if unit.flat.offload:
        own["offload"] = True
    return {
        "name": unit.label,
        **flat_layout(unit.flat),
        "reshard_after_forward": unit.reshard_after_forward,
        **own,  # a unit with its own strategy (`shard(policies=...)`) says which
    }


def build_model(cfg: ShardConfig) -> torch.nn.Module:
    """The factory's model on this rank's device: the same initial weights in every run."""
    return load_factory(cfg.model)().to(device())


def unit_classes(model: torch.nn.Module) -> tuple[type, ...]:
    """Wrap the repeated blocks (the ModuleList children), as one does for a transformer."""
    blocks = {
        type(m) for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst
    }
    return tuple(blocks)


def sharded_model(
    cfg: ShardConfig,
    strategy: str,
    prefetch: bool = True,
    mesh: Any = None,
    free_root: bool = False,
    replicate_root: bool = False,
    offload: bool = False,
) -> torch.nn.Module:
    """Ours: `fsdp_lab.shard` with a unit per block (everything else in the root unit);
    `free_root`: every unit, the root too, freed after forward (default: all but the root);
    `replicate_root`: the root whole on every rank, its gradient all-reduced; `offload`: every
    shard in host memory."""
    model = build_model(cfg)
    units = unit_classes(model) if strategy != "none" else ()  # "none": DDP's one unit
    every = list(build_plan(model, set(units) or None).units) if free_root else None
    return reference.wrap(
        model,
        f"ours:{strategy}",
        units,
        mesh,
        prefetch=prefetch,
        reshard_after_forward=every,
        policies={ROOT: UnitPolicy(strategy="replicate")} if replicate_root else None,
        offload=offload,
    )


def optimizer_recipe(cfg: ShardConfig) -> functools.partial[torch.optim.Optimizer]:
    """The optimizer class with its arguments: each run calls it on its own parameters (and the
    sharded optimizers take ``.func`` and ``.keywords``)."""
    if cfg.optimizer == "adam":
        return functools.partial(torch.optim.Adam, lr=cfg.lr)
    return functools.partial(torch.optim.SGD, lr=cfg.lr, momentum=0.9)


def timed_training(
    cfg: ShardConfig, model: torch.nn.Module, opt: Any, vocab: int
) -> tuple[list[float], float]:
    """This rank's losses and its median step time."""
    stamps = [time.perf_counter()]
    losses = reference.train_steps(
        model,
        opt,
        cfg.steps,
        global_batch=cfg.global_batch,
        rank=rank(),
        world=world_size(),
        device=device(),
        on_step=lambda _: stamps.append(time.perf_counter()),
        vocab_size=vocab,
    )
    per_step = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    # The first step records the unit order and creates the optimizer state: leave it out.
    return losses, statistics.median(per_step[1:] if len(per_step) > 1 else per_step)


def tracked_training(
    cfg: ShardConfig,
    strategy: str,
    prefetch: bool,
    make_optimizer: Any,
    vocab: int,
    mesh: Any = None,
    free_root: bool = False,
    replicate_root: bool = False,
    offload: bool = False,
) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """Ours under `strategy` (on `mesh`), trained under the memory tracker (parameters,
    gradients, optimizer state, gathered buffers), the comm log (the steps' collectives, not the
    wrap's) and the timeline. Returns the model, its optimizer and what was measured."""
    with MemoryTracker(device(), rank=rank()) as mem, comm.CommLog() as log, Timeline(rank()) as tl:
        model = sharded_model(cfg, strategy, prefetch, mesh, free_root, replicate_root, offload)
        opt = make_optimizer(model.parameters())
        at_wrap = len(log.records)  # "none" broadcasts rank 0's values here, as DDP does
        mem.track(model)
        mem.track(opt)
        state = sharding_state(model)
        for unit in state.units:
            if not unit.flat.aliased:  # DDP's buffer is the parameter itself
                mem.track(unit.flat.unsharded, "comm_buffers")  # its .grad as "gradients"
        mem.mark("sharded")
        losses, _ = timed_training(cfg, model, opt, vocab)
    steps = log.records[at_wrap:]
    measured = {
        "losses": losses,
        "params": reference.full_parameters(model),
        "comm_bytes_per_step": {op: b / cfg.steps for op, b in comm.bytes_by_op(steps).items()},
        "calls_per_step": {op: c / cfg.steps for op, c in comm.calls_by_op(steps).items()},
        "comm_bytes_per_step_by_group": {
            group: {
                op: b / cfg.steps
                for op, b in comm.bytes_by_op([r for r in steps if r.group == group]).items()
            }
            for group in dict.fromkeys(r.group for r in steps)
        },
        "memory_trace": mem.trace(),
        "timeline": tl.to_dict(),
        "units": [unit_layout(u) for u in state.units],
    }
    return model, opt, measured


@in_rank_threads  # N ranks x default threads oversubscribe the cores
def _ours(cfg: ShardConfig, vocab: int) -> dict[str, Any]:
    """`fsdp_lab.shard(strategy=cfg.strategy)`, measured; then trained again, for its step time."""
    recipe = optimizer_recipe(cfg)
    options = {
        "free_root": cfg.free_root,
        "replicate_root": cfg.replicate_root,
        "offload": cfg.offload,
    }
    _, _, measured = tracked_training(cfg, cfg.strategy, cfg.prefetch, recipe, vocab, **options)
    # Timed without the tracker, whose dispatch mode and marks cost more than a step.
    timed = sharded_model(cfg, cfg.strategy, cfg.prefetch, **options)
    _, step_time = timed_training(cfg, timed, recipe(timed.parameters()), vocab)
    return {**measured, "step_time_s": step_time}


@in_rank_threads  # N ranks x default threads oversubscribe the cores
def _fsdp2(cfg: ShardConfig, vocab: int) -> dict[str, Any]:
    """PyTorch's `fully_shard` on the same blocks."""
    model = build_model(cfg)
    reference.wrap(model, "fully_shard", unit_classes(model))
    losses, step_time = timed_training(cfg, model, optimizer_recipe(cfg)(model.parameters()), vocab)
    return {"losses": losses, "step_time_s": step_time, "params": reference.full_parameters(model)}


@in_rank_threads  # N ranks x default threads oversubscribe the cores
def _ddp_sharded_optimizer(cfg: ShardConfig, vocab: int) -> dict[str, Any]:
    """ZeRO-1 as an optimizer: DDP's all-reduce, then `ShardedOptimizer` steps and broadcasts."""
    recipe = optimizer_recipe(cfg)
    sharded_optimizer = functools.partial(
        ShardedOptimizer, optimizer_class=recipe.func, **recipe.keywords
    )
    model, opt, measured = tracked_training(cfg, "none", True, sharded_optimizer, vocab)
    owned = opt.params_per_rank
    return {
        **measured,
        "owned_numel_per_rank": [sum(p.numel() for p in ps) for ps in owned],
        "owned_tensors_per_rank": [len(ps) for ps in owned],
        "trainable_numel": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "element_size": next(model.parameters()).element_size(),
    }


@in_rank_threads  # N ranks x default threads oversubscribe the cores
def _ddp_zero_redundancy(cfg: ShardConfig, vocab: int) -> dict[str, torch.Tensor]:
    """PyTorch's own: DistributedDataParallel + ZeroRedundancyOptimizer, same model and data."""
    model = reference.wrap(build_model(cfg), "ddp")
    recipe = optimizer_recipe(cfg)
    opt = reference.make_optimizer("ddp+zero", model.parameters(), recipe.func, **recipe.keywords)
    timed_training(cfg, model, opt, vocab)
    return reference.full_parameters(model)


def single_process_reference(config: Any, vocab: int) -> dict[str, torch.Tensor]:
    """The ground truth: the config's model (`model`, `optimizer`, `lr`, `steps`,
    `global_batch`) trained in this process on the whole batch."""
    return reference.single_process(
        load_factory(config.model),
        optimizer_recipe(config),
        config.steps,
        global_batch=config.global_batch,
        vocab_size=vocab,
    )


def measure(
    config: ShardConfig, cluster: Cluster | AttachedCluster | None = None
) -> dict[str, Any]:
    """Every run's per-rank results, and the single process's parameters; `cluster` is reused
    if given (its world size wins)."""
    with borrow(cluster, config.world_size, config.backend) as ranks:
        check_batch_divides(config.global_batch, ranks.world_size)
        # The --model contract, on rank 0 where it trains, before anything is sharded.
        vocab = ranks.run(check_on_rank0, config.model)[0]
        ours = ranks.run(_ours, config, vocab)
        fsdp2 = ranks.run(_fsdp2, config, vocab) if config.compare_fsdp2 else None
        as_optimizer = config.strategy == "optimizer" and config.sharded_optimizer
        sharded_opt = ranks.run(_ddp_sharded_optimizer, config, vocab) if as_optimizer else None
        pytorch_zero1 = as_optimizer and config.compare_fsdp2
        zero_redundancy = ranks.run(_ddp_zero_redundancy, config, vocab) if pytorch_zero1 else None
        n, backend = ranks.world_size, ranks.backend
    # The ground truth, here once the ranks are gone: one process on the whole batch.
    single = single_process_reference(config, vocab)
    return {
        "world_size": n,
        "backend": backend,
        "vocab_size": vocab,
        "ours": ours,
        "fsdp2": fsdp2,
        "sharded_optimizer": sharded_opt,
        "zero_redundancy": zero_redundancy,
        "single_process": single,
    }
