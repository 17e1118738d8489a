"""Lab 05, on the ranks: initialise each rank's stage with every strategy (timed, its messages
counted by `fsdp_lab.comm`, its peak memory by `fsdp_lab.trace`), keep the initial values, train
the pipeline with GPipe; grow the model and initialise again; train the unsplit reference.

`fsdp_lab.pipeline.rng.init_stage` only initialises; what it costs is measured here, around it.
Nothing here compares or draws (`analysis.py`, `report.py`).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fsdp_lab import comm, reference
from fsdp_lab.cluster import AttachedCluster, Cluster, borrow, device, intra_op_threads, rank
from fsdp_lab.labs.pp_seed.config import OPTIMIZERS, PPSeedConfig
from fsdp_lab.pipeline import PipeGPT, PipeGPTConfig, dp_group, stage_info, train_pipeline
from fsdp_lab.pipeline.rng import CHECKPOINT_NAME, generator_state, init_stage
from fsdp_lab.trace import MemoryTracker


def make_optimizer(config: PPSeedConfig, params: Any) -> torch.optim.Optimizer:
    lr = OPTIMIZERS[config.optimizer] if config.lr is None else config.lr
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


@contextmanager
def shared_folder() -> Iterator[str]:
    """A fresh folder every rank can read, removed when all are done with it. Rank 0 makes it
    and broadcasts its path: under torchrun each rank runs the lab, so each would make its own."""
    path = tempfile.mkdtemp(prefix="fsdp_lab_pp_seed_") if rank() == 0 else ""
    size = torch.tensor([len(path.encode())], dtype=torch.int64, device=device())
    comm.broadcast(size, src=0)
    data = torch.zeros(int(size), dtype=torch.uint8, device=device())
    if rank() == 0:
        data.copy_(torch.tensor(list(path.encode()), dtype=torch.uint8))
    comm.broadcast(data, src=0)
    try:
        yield bytes(data.cpu().tolist()).decode()
        comm.all_reduce(torch.zeros(1, device=device()))  # every rank is done with the folder
    finally:
        if rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


def measured_init(
    config: PPSeedConfig, strategy: str, model_config: PipeGPTConfig, folder: str
) -> tuple[nn.Module, dict[str, Any]]:
    """This rank's stage initialised with `strategy`, and what that cost: wall time, peak live
    tensor bytes, bytes sent and messages (send, recv and broadcast calls)."""
    info = stage_info(rank(), config.world_size, config.stages, config.layers)
    torch.manual_seed(10_000 + rank())  # whatever a rank drew before must not matter
    with comm.CommLog() as log, MemoryTracker(device()) as mem:
        start = time.perf_counter()
        model = init_stage(
            strategy, model_config, info, config.seed, device=device(), checkpoint_dir=folder
        )
        seconds = time.perf_counter() - start
    by_op = log.bytes_by_op()
    # A recv is the other end of a send: counting both would count every handoff twice.
    sent = by_op.get("send", 0) + by_op.get("broadcast", 0)
    report = {
        "init_time_s": seconds,
        "peak_bytes": mem.peak_bytes,
        "bytes_moved": sent,
        "messages": sum(log.calls_by_op().values()),
    }
    if strategy == "seed_checkpoint":
        report["checkpoint_file_bytes"] = (Path(folder) / CHECKPOINT_NAME).stat().st_size
    return model, report


def _strategies(config: PPSeedConfig, folder: str) -> dict[str, Any]:
    """Every strategy in turn: initialise (measured), keep the initial values, train."""
    for strategy in config.strategies:  # warm-up: first calls pay one-time costs (not kept)
        measured_init(config, strategy, config.gpt(), folder)
    info = stage_info(rank(), config.world_size, config.stages, config.layers)
    group = dp_group(info)  # created once: process groups are not freed
    schedule = (config.steps, config.microbatches, config.global_batch, config.seq_len)
    out: dict[str, Any] = {"rank": rank(), "stage": info.stage, "dp_rank": info.dp_rank}
    for strategy in config.strategies:
        model, report = measured_init(config, strategy, config.gpt(), folder)
        initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        optimizer = make_optimizer(config, model.parameters())
        losses = train_pipeline(model, info, optimizer, *schedule, group=group)
        out[strategy] = {"init": report, "params": initial, "losses": losses}
        del model, optimizer
    return out


def _growth(config: PPSeedConfig, folder: str) -> list[dict[str, Any]]:
    """Per width in `grow_dims`: each strategy's init cost on this rank (no training)."""
    if not config.grow_dims:
        return []
    for strategy in config.strategies:  # warm-up at the smallest width, not kept
        measured_init(config, strategy, config.gpt(min(config.grow_dims)), folder)
    return [
        {s: measured_init(config, s, config.gpt(dim), folder)[1] for s in config.strategies}
        for dim in config.grow_dims
    ]


def _baseline(config: PPSeedConfig) -> dict[str, Any]:
    """The unsplit reference init, and single-process training from it."""
    model = PipeGPT(config.gpt()).to(device())
    torch.manual_seed(config.seed)
    model.init_weights()
    initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    losses = reference.train_steps(
        model,
        make_optimizer(config, model.parameters()),
        config.steps,
        global_batch=config.global_batch,
        seq_len=config.seq_len,
        device=device(),
    )
    return {"params": initial, "losses": losses}


@intra_op_threads(1)  # tiny matmuls: more threads only contend
def _worker(config: PPSeedConfig) -> dict[str, Any]:
    with shared_folder() as folder:
        out = _strategies(config, folder)
        out["growth"] = _growth(config, folder)
    state = generator_state(device())
    out["generator_state_bytes"] = state.numel() * state.element_size()
    out["baseline"] = _baseline(config) if rank() == 0 else None
    return out


def measure(
    config: PPSeedConfig, cluster: Cluster | AttachedCluster | None = None
) -> dict[str, Any]:
    """Every rank's measurements (initial values as tensors); `cluster` is reused if given."""
    with borrow(cluster, config.world_size, config.backend) as ranks:
        # The cluster's size wins (torchrun's, too); `replace` checks that S still divides it.
        config = replace(config, world_size=ranks.world_size)
        per_rank = ranks.run(_worker, config)
        return {"world_size": ranks.world_size, "backend": ranks.backend, "per_rank": per_rank}
