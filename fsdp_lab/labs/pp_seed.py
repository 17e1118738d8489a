"""Lab 05 — pipeline-parallel RNG seeding: four ways to initialise a pipeline's stages, and
which of them equal the unsplit model bitwise, at what cost.

The unsplit model is initialised by ``PipeGPT(config); torch.manual_seed(s);
model.init_weights()``: one random stream, read module after module. A pipeline gives each
rank a contiguous slice of the modules (`fsdp_lab.pipeline.stages`), and each of the four
strategies of `fsdp_lab.pipeline.rng` initialises that slice differently:

    seed_checkpoint   rank 0 builds the whole model, saves it, every stage loads its keys
    same_seed         every stage seeds alike (the bug: later stages repeat stage 0's draws)
    per_stage_seed    one broadcast seed per stage (distinct, but not the unsplit init)
    rng_replay        the recorded init order replayed, the generator state handed on

On live ranks the lab initialises the pipeline with each strategy (timed, its peak memory and
messages measured by `init_stage`), compares every stage with the unsplit reference, measures
how much the stages repeat each other's draws (`fsdp_lab.labs.pp_seed_report`), trains each
pipeline with GPipe (`train_pipeline`) beside single-process training of the reference, and
grows the model to show what the seed checkpoint costs rank 0. With more ranks than stages
(a pp x dp mesh) it checks that the replicas of a stage got the same weights.

Mirrors torchtitan's seed checkpoint (``--checkpoint.create_seed_checkpoint``) and
``torch.distributed.pipelining``'s stage split; see `fsdp_lab.pipeline.rng` for the four.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fsdp_lab import comm, reference
from fsdp_lab.cluster import (
    AttachedCluster,
    Cluster,
    device,
    intra_op_threads,
    rank,
    world_size,
)
from fsdp_lab.labs import LabResult
from fsdp_lab.labs.pp_seed_config import OPTIMIZERS, PPSeedConfig
from fsdp_lab.labs.pp_seed_report import analyse, figures, summary
from fsdp_lab.pipeline import PipeGPT, PipeGPTConfig, dp_group, stage_info, train_pipeline
from fsdp_lab.pipeline.rng import CHECKPOINT_NAME, STRATEGIES, generator_state, init_stage

__all__ = ["STRATEGIES", "PPSeedConfig", "figures", "run", "summary"]


def make_optimizer(config: PPSeedConfig, params: Any) -> torch.optim.Optimizer:
    lr = OPTIMIZERS[config.optimizer] if config.lr is None else config.lr
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


# -- on every rank -----------------------------------------------------------------------------


def shared_dir_worker() -> str:
    """A fresh folder that every rank can read (rank 0 makes it and broadcasts its path):
    under torchrun each rank runs the lab's `run`, so a folder made there would differ."""
    path = tempfile.mkdtemp(prefix="fsdp_lab_pp_seed_") if rank() == 0 else ""
    size = torch.tensor([len(path.encode())], dtype=torch.int64, device=device())
    comm.broadcast(size, src=0)
    data = torch.zeros(int(size), dtype=torch.uint8, device=device())
    if rank() == 0:
        data.copy_(torch.tensor(list(path.encode()), dtype=torch.uint8))
    comm.broadcast(data, src=0)
    return bytes(data.cpu().tolist()).decode()


def remove_dir_worker(path: str) -> None:
    comm.all_reduce(torch.zeros(1, device=device()))  # every rank is done with the folder
    if rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def _init(config: PPSeedConfig, strategy: str, model_config: PipeGPTConfig, folder: str):
    info = stage_info(rank(), world_size(), config.stages, config.layers)
    torch.manual_seed(10_000 + rank())  # whatever a rank drew before must not matter
    model, report = init_stage(
        strategy, model_config, info, config.seed, device=device(), checkpoint_dir=folder
    )
    return info, model, report


@intra_op_threads(1)  # tiny matmuls: more threads only contend
def strategies_worker(config: PPSeedConfig, folder: str) -> dict[str, Any]:
    """Every strategy in turn: initialise this rank's stage (measured), keep a copy of the
    initial values, train `steps` GPipe steps. Returns what this rank saw, per strategy."""
    for strategy in config.strategies:  # warm-up: first calls pay one-time costs (not timed)
        _init(config, strategy, config.gpt(), folder)
    info = stage_info(rank(), world_size(), config.stages, config.layers)
    group = dp_group(info)  # created once: process groups are not freed
    out: dict[str, Any] = {"rank": rank(), "stage": info.stage, "dp_rank": info.dp_rank}
    for strategy in config.strategies:
        info, model, report = _init(config, strategy, config.gpt(), folder)
        if strategy == "seed_checkpoint":
            report["checkpoint_file_bytes"] = (Path(folder) / CHECKPOINT_NAME).stat().st_size
        initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        optimizer = make_optimizer(config, model.parameters())
        losses = train_pipeline(
            model,
            info,
            optimizer,
            config.steps,
            config.microbatches,
            config.global_batch,
            config.seq_len,
            group=group,
        )
        out[strategy] = {"init": report, "params": initial, "losses": losses}
        del model, optimizer
    state = generator_state(device())
    out["generator_state_bytes"] = state.numel() * state.element_size()
    return out


@intra_op_threads(1)  # tiny matmuls: more threads only contend
def growth_worker(config: PPSeedConfig, folder: str) -> list[dict[str, Any]]:
    """Init time and peak bytes of every strategy at each width in `grow_dims` (no training)."""
    rows = []
    for strategy in config.strategies:  # warm-up at the smallest width, not recorded
        _init(config, strategy, config.gpt(min(config.grow_dims)), folder)
    for dim in config.grow_dims:
        row: dict[str, Any] = {"dim": dim}
        for strategy in config.strategies:
            _, model, report = _init(config, strategy, config.gpt(dim), folder)
            row[strategy] = report
            del model
        rows.append(row)
    return rows


@intra_op_threads(1)  # tiny matmuls: more threads only contend
def baseline_worker(config: PPSeedConfig) -> dict[str, Any] | None:
    """On rank 0: the unsplit reference init, and single-process training from it."""
    if rank() != 0:
        return None
    model = PipeGPT(config.gpt()).to(device())
    torch.manual_seed(config.seed)
    model.init_weights()
    initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    start = time.perf_counter()
    losses = reference.train_steps(
        model,
        make_optimizer(config, model.parameters()),
        config.steps,
        global_batch=config.global_batch,
        seq_len=config.seq_len,
        device=device(),
    )
    return {"params": initial, "losses": losses, "train_time_s": time.perf_counter() - start}


# -- the lab ------------------------------------------------------------------------------------


def run(
    config: PPSeedConfig = PPSeedConfig(), cluster: Cluster | AttachedCluster | None = None
) -> LabResult:
    """Initialise, compare, train and grow; see the module docstring."""
    owned = cluster is None
    cluster = cluster or Cluster(config.world_size, config.backend)
    try:
        if cluster.world_size != config.world_size:  # the cluster decides (torchrun, too)
            config = replace(config, world_size=cluster.world_size)
        folder = cluster.run(shared_dir_worker)[0]
        try:
            ranks = cluster.run(strategies_worker, config, folder)
            growth = cluster.run(growth_worker, config, folder) if config.grow_dims else []
        finally:
            cluster.run(remove_dir_worker, folder)
        base = cluster.run(baseline_worker, config)[0]
        backend = cluster.backend
    finally:
        if owned:
            cluster.close()
    return LabResult("pp-seed", analyse(config, ranks, growth, base, backend))
