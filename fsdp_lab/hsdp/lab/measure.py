"""Lab 06, on the ranks: the same model and data trained by full FSDP (ZeRO-3 over every rank),
HSDP (`hybrid`: ZeRO-3 inside each shard group, gradients all-reduced across replicas) and
`hybrid_zero2` on one (R, S) mesh — each measured as it trains (bytes per group and op, model
state per rank) — then PyTorch's HSDP twins on the same 2-D DeviceMesh, and one process.
"""

from __future__ import annotations

import os
from typing import Any

from fsdp_lab import comm, reference
from fsdp_lab.cluster import AttachedCluster, Cluster, borrow, in_rank_threads, shared_folder
from fsdp_lab.hsdp.lab.config import SYSTEMS, HsdpConfig
from fsdp_lab.hsdp.lab.emulated import measure_emulated
from fsdp_lab.model_spec import check_on_rank0
from fsdp_lab.sharding import load_sharded, save_sharded, sharding_state
from fsdp_lab.sharding.lab.measure import (
    build_model,
    optimizer_recipe,
    sharded_model,
    single_process_reference,
    timed_training,
    tracked_training,
    unit_classes,
)
from fsdp_lab.sharding.mesh import device_mesh

TWINS = {  # PyTorch's HSDP on the same 2-D mesh (`reference.SYSTEMS`) -> our strategy it twins
    "fully_shard": "hybrid",
    "fully_shard:keep": "hybrid_zero2",
    "fsdp1:HYBRID_SHARD": "hybrid",
    "fsdp1:_HYBRID_SHARD_ZERO2": "hybrid_zero2",
}


@in_rank_threads  # N ranks x default threads oversubscribe the cores
def ours_worker(config: HsdpConfig, system: str, vocab: int) -> dict[str, Any]:
    """One of `SYSTEMS` trained under the tracker and the comm log; bytes per step by the kind
    of group they crossed ("shard" inside a node, "replicate" across nodes, "world")."""
    mesh = config.mesh if system != "full" else None
    model, _, m = tracked_training(config, system, True, optimizer_recipe(config), vocab, mesh)
    groups = sharding_state(model).groups
    kinds = {comm.group_label(groups.group): "world" if mesh is None else "shard"}
    if groups.replicate_group is not None:
        kinds[comm.group_label(groups.replicate_group)] = "replicate"
    by_kind = {kinds[g]: ops for g, ops in m.pop("comm_bytes_per_step_by_group").items()}
    return {**m, "comm_bytes_per_step_by_group": by_kind}


@in_rank_threads  # N ranks x default threads oversubscribe the cores
def twin_worker(config: HsdpConfig, twin: str, vocab: int) -> dict[str, Any]:
    """PyTorch's HSDP on the same (replicate, shard) DeviceMesh: its trained parameters."""
    model = build_model(config)
    model = reference.wrap(model, twin, unit_classes(model), device_mesh(*config.mesh))
    losses, _ = timed_training(config, model, optimizer_recipe(config)(model.parameters()), vocab)
    return {"losses": losses, "params": reference.full_parameters(model)}


@in_rank_threads  # N ranks x default threads oversubscribe the cores
def checkpoint_worker(config: HsdpConfig, system: str, folder: str, vocab: int) -> dict[str, Any]:
    """Train one step, save a sharded checkpoint (`save_sharded`: under HSDP only the first
    replica writes), train once more, reload on every rank: back to the saved values bitwise?
    Rank 0 also lists the files written and their bytes."""
    model = sharded_model(config, system, True, config.mesh if system != "full" else None)
    opt = optimizer_recipe(config)(model.parameters())
    timed_training(config, model, opt, vocab)
    saved = reference.full_parameters(model)
    save_sharded(model, folder, opt)
    files = {
        os.path.relpath(os.path.join(d, f), folder): os.path.getsize(os.path.join(d, f))
        for d, _, names in os.walk(folder)
        for f in names
    }
    timed_training(config, model, opt, vocab)
    moved = reference.max_abs_diff(reference.full_parameters(model), saved)
    load_sharded(model, folder, opt)
    back = reference.max_abs_diff(reference.full_parameters(model), saved)
    return {"files": files, "moved_after_save": moved, "diff_after_reload": back}


def measure(config: HsdpConfig, cluster: Cluster | AttachedCluster | None = None) -> dict[str, Any]:
    """Every system's per-rank results on the ranks, then single-process training here."""
    with borrow(cluster, config.world_size, config.backend) as ranks:
        if ranks.world_size != config.world_size:
            raise ValueError(
                f"the cluster has {ranks.world_size} ranks but mesh={config.mesh} needs "
                f"{config.world_size}. Fix: world_size={ranks.world_size} and a mesh of it"
            )
        vocab = ranks.run(check_on_rank0, config.model)[0]
        ours = {s: ranks.run(ours_worker, config, s, vocab) for s in SYSTEMS}
        twins = (
            {t: ranks.run(twin_worker, config, t, vocab)[0]["params"] for t in TWINS}
            if config.compare_pytorch
            else {}
        )
        with shared_folder(ranks, "fsdp_lab_hsdp_") as tmp:  # torchrun: one for every rank
            checkpoints = {
                s: ranks.run(checkpoint_worker, config, s, os.path.join(tmp, s), vocab)
                for s in ("full", "hybrid")
            }
        backend = ranks.backend
    emulated = measure_emulated(config)  # its own processes, in their own namespaces
    single = single_process_reference(config, vocab)
    return {
        "backend": backend,
        "ours": ours,
        "pytorch": twins,
        "checkpoint": checkpoints,
        "emulated": emulated,
        "single_process": single,
    }
