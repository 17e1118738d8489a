"""Lab 05, on the ranks: initialise each rank's stage with every strategy (timed, its messages
counted by `fsdp_lab.comm`, its peak memory by `fsdp_lab.trace`), keep the initial values, train
the pipeline with GPipe; grow the model and initialise again; train the unsplit reference.
If asked: time the init again on pipelines of 1, 2, ... ranks, and train the unsplit and the
same-seed inits on a learnable task (`convergence`), the trainings spread over the ranks.

Every timed init is repeated (`repeats`) with the ranks in step before each repeat, and keeps
its wall time and its CPU time: one wall time on a shared machine moves with whatever else runs
there, which is why the lab reports medians and shows the spread.

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
from statistics import median
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab import comm, reference, theory
from fsdp_lab.cluster import (
    AttachedCluster,
    Cluster,
    borrow,
    device,
    intra_op_threads,
    rank,
    world_size,
)
from fsdp_lab.cores import available_cores
from fsdp_lab.host import check_fits
from fsdp_lab.pipeline import (
    PipeGPT,
    PipeGPTConfig,
    StageInfo,
    dp_group,
    stage_info,
    train_pipeline,
)
from fsdp_lab.pipeline.lab import convergence
from fsdp_lab.pipeline.lab.config import OPTIMIZERS, PPSeedConfig
from fsdp_lab.pipeline.rng import CHECKPOINT_NAME, generator_state, init_stage
from fsdp_lab.trace import MemoryTracker


def preflight(config: PPSeedConfig) -> None:
    """What `fsdp-lab pp-seed` checks before starting any rank: its PipeGPT (and the widest of
    `grow_dims`) fits this host, built whole on every rank (seed checkpoint, one-process
    reference) and trained on the global batch there and in one process
    (`theory.gpt_host_bytes`)."""
    dim = max([config.dim, *config.grow_dims, config.scale_dim or 0])
    params = theory.gpt_parameters(config.vocab, dim, config.layers, config.seq_len)
    tokens = 2 * config.global_batch * config.seq_len  # the ranks, then one process
    check_fits(
        theory.gpt_host_bytes(params, config.world_size + 1, tokens, config.vocab),
        f"vocab={config.vocab}, dim={dim}, layers={config.layers} ({params / 1e6:.0f}M "
        f"parameters), global_batch={config.global_batch} x seq_len={config.seq_len} on "
        f"{config.world_size} ranks",
        "smaller --dim/--grow-dims/--vocab/--layers/--global-batch/--seq-len (the defaults fit "
        "any laptop)",
    )


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


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    """Every rank here before any clock starts: no rank's time includes another rank still busy
    with the previous init (outside the measured window, so not counted as the init's bytes)."""
    comm.all_reduce(torch.zeros(1, device=device()), group=group)


def _init(
    strategy: str,
    config: PPSeedConfig,
    model_config: PipeGPTConfig,
    info: StageInfo,
    folder: str,
    group: dist.ProcessGroup | None,
) -> nn.Module:
    """This rank's stage initialised once with `strategy`: the call the warm-up and the
    measured repeats both make."""
    return init_stage(
        strategy,
        model_config,
        info,
        config.seed,
        device=device(),
        checkpoint_dir=folder,
        group=group,
    )


def measured_init(
    config: PPSeedConfig,
    strategy: str,
    model_config: PipeGPTConfig,
    folder: str,
    info: StageInfo | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """This rank's stage initialised with `strategy` `config.repeats` times, and what that cost:
    wall time and this thread's CPU time per repeat (their medians), peak live tensor bytes,
    bytes sent and messages (send, recv and broadcast calls; the same every repeat).

    Wall time is what the pipeline waits for: this rank's work, its wait for messages (RNG
    replay's stages wait for the ones before) and its wait for a core when ranks outnumber cores.
    CPU time is the work alone. `group`: the ranks of the pipeline (default: all)."""
    info = info or stage_info(rank(), config.world_size, config.stages, config.layers)
    walls, cpus = [], []
    model = None
    for _ in range(config.repeats):
        del model  # the last repeat's stage must not count in this one's peak
        _barrier(group)
        torch.manual_seed(10_000 + rank())  # whatever a rank drew before must not matter
        with comm.CommLog() as log, MemoryTracker(device()) as mem:
            wall, cpu = time.perf_counter(), time.thread_time()
            model = _init(strategy, config, model_config, info, folder, group)
            cpus.append(time.thread_time() - cpu)
            walls.append(time.perf_counter() - wall)
    by_op = log.bytes_by_op()
    # A recv is the other end of a send: counting both would count every handoff twice.
    sent = by_op.get("send", 0) + by_op.get("broadcast", 0)
    report = {
        "init_time_s": median(walls),
        "init_time_s_runs": walls,
        "cpu_time_s": median(cpus),
        "cpu_time_s_runs": cpus,
        "peak_bytes": mem.peak_bytes,
        "bytes_moved": sent,
        "messages": sum(log.calls_by_op().values()),
    }
    if strategy == "seed_checkpoint":
        report["checkpoint_file_bytes"] = (Path(folder) / CHECKPOINT_NAME).stat().st_size
    assert model is not None  # repeats >= 1 (the config checks it)
    return model, report


def _warm_up(
    config: PPSeedConfig,
    model_config: PipeGPTConfig,
    folder: str,
    info: StageInfo | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Each strategy once, not kept: first calls pay one-time costs (imports, caches). Returns
    their wall times, so the report can say what a first call costs."""
    info = info or stage_info(rank(), config.world_size, config.stages, config.layers)
    seconds = {}
    for strategy in config.strategies:
        _barrier(group)
        start = time.perf_counter()
        _init(strategy, config, model_config, info, folder, group)
        seconds[strategy] = time.perf_counter() - start
    return seconds


def _strategies(config: PPSeedConfig, folder: str) -> dict[str, Any]:
    """Every strategy in turn: initialise (measured), keep the initial values, train."""
    first = _warm_up(config, config.gpt(), folder)  # this process's first call of each
    info = stage_info(rank(), config.world_size, config.stages, config.layers)
    group = dp_group(info)  # created once: process groups are not freed
    schedule = (config.steps, config.microbatches, config.global_batch, config.seq_len)
    out: dict[str, Any] = {"rank": rank(), "stage": info.stage, "dp_rank": info.dp_rank}
    out["first_call_s"] = first
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
    _warm_up(config, config.gpt(min(config.grow_dims)), folder)
    return [
        {s: measured_init(config, s, config.gpt(dim), folder)[1] for s in config.strategies}
        for dim in config.grow_dims
    ]


@intra_op_threads(1)
def _scaling_worker(config: PPSeedConfig, counts: list[int]) -> list[dict[str, Any] | None]:
    """For each n in `counts`: one pipeline of n stages on ranks 0..n-1 of this cluster (their
    own process group; the other ranks wait), `scale_strategies` initialised at width
    `scale_width`, measured. The same warm processes for every n: a fresh process pays its
    first imports, which would weigh on the fewest ranks' times."""
    model_config = config.gpt(config.scale_width)
    timed = replace(config, strategies=config.scale_strategies)
    out: list[dict[str, Any] | None] = []
    with shared_folder() as folder:
        for n in counts:
            # Made by every rank, as new_group must be; the world's own group when n is all.
            group = None if n == world_size() else dist.new_group(list(range(n)))
            try:
                if rank() < n:
                    info = stage_info(rank(), n, n, config.layers)
                    _warm_up(timed, model_config, folder, info, group)
                    out.append(
                        {
                            s: measured_init(timed, s, model_config, folder, info, group)[1]
                            for s in timed.strategies
                        }
                    )
                else:
                    out.append(None)
                _barrier()  # the idle ranks wait here, outside every measurement
            finally:
                if group is not None:
                    dist.destroy_process_group(group)
    return out


def _scaling(config: PPSeedConfig, ranks: Cluster | AttachedCluster) -> list[dict[str, Any]]:
    """`_scaling_worker` for every count of `scale_ranks`: on the lab's own ranks up to their
    number, on a fresh cluster (closed afterwards) for each larger count."""
    fit = [n for n in config.scale_ranks if n <= ranks.world_size]
    per_count = ranks.run(_scaling_worker, config, fit) if fit else []
    out = [
        {"ranks": n, "per_rank": [r[i] for r in per_count if r[i] is not None]}
        for i, n in enumerate(fit)
    ]
    for n in (n for n in config.scale_ranks if n > ranks.world_size):
        if isinstance(ranks, AttachedCluster):
            raise ValueError(
                f"scale_ranks={config.scale_ranks}: under torchrun at most the launched "
                f"world_size={ranks.world_size} ranks can be measured. Fix: scale_ranks="
                f"{tuple(fit) or (1,)}, or launch {max(config.scale_ranks)} ranks"
            )
        with Cluster(n, config.backend, verbose=False) as bigger:
            (per_rank,) = zip(*bigger.run(_scaling_worker, config, [n]), strict=True)
        out.append({"ranks": n, "per_rank": list(per_rank)})
    return out


@intra_op_threads(1)
def _convergence_worker(config: PPSeedConfig) -> list[tuple[int, str, list[float]]]:
    """This rank's share of the convergence trainings (`convergence.jobs`, dealt round-robin)."""
    mine = convergence.jobs(config)[rank() :: world_size()]
    return [(seed, init, convergence.train(config, init, seed)) for seed, init in mine]


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
    """Every rank's measurements (initial values as tensors); `cluster` is reused if given.
    Then, if asked, the init timed on other numbers of ranks and the convergence trainings."""
    with borrow(cluster, config.world_size, config.backend) as ranks:
        # The cluster's size wins (torchrun's, too); `replace` checks that S still divides it.
        config = replace(config, world_size=ranks.world_size)
        per_rank = ranks.run(_worker, config)
        scaling = _scaling(config, ranks)
        trained = ranks.run(_convergence_worker, config) if config.convergence_seeds else []
        return {
            "world_size": ranks.world_size,
            "backend": ranks.backend,
            "cores": available_cores(),
            "per_rank": per_rank,
            "scaling": scaling,
            "convergence": [job for share in trained for job in share],
        }
