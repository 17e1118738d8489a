"""The map of parallelisms: what each strategy splits, what it sends, how many bytes per step —
measured for the ones fsdp_lab builds, from `fsdp_lab.theory` for the ones it does not.

Course notes end with a table of four strategies — data (split the batch), context (split the
sequence), pipeline (split the layers), tensor (split each layer's matrices) — and "use all of
them". `run(cluster)` puts numbers on that table for one model (`PipeGPT`, the pipeline lab's
small GPT) on the cluster's N ranks: it trains one step of each strategy built here — DDP, FSDP
(ZeRO-3), HSDP on an (R, S) = (2, N/2) mesh, a GPipe pipeline of N stages — under
`comm.CommLog`, and sets the bytes all ranks sent beside the formula for the same model and
batch. Tensor and context parallelism are not built here: their rows are formulas only
(`theory.tensor_parallel_step_bytes`, `theory.context_parallel_step_bytes`), and say so.
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_lab import comm, reference, theory
from fsdp_lab.cluster import AttachedCluster, Cluster, rank, world_size
from fsdp_lab.markdown import table
from fsdp_lab.pipeline.model import pipe_gpt
from fsdp_lab.pipeline.schedule import train_pipeline
from fsdp_lab.pipeline.split import split_model
from fsdp_lab.pipeline.stages import stage_info
from fsdp_lab.sharding import shard, sharding_state
from fsdp_lab.sharding.lab.measure import unit_layout
from fsdp_lab.sizes import format_bytes

SEQ_LEN = 16
MICROBATCHES = 2

WHAT = {  # strategy -> (what it splits over the ranks, what it sends every step)
    "data (DDP)": ("the batch", "all-reduce of every gradient"),
    "data, sharded (FSDP)": (
        "the batch + parameters, gradients, optimizer state",
        "all-gather of the parameters (forward, backward), reduce-scatter of the gradients",
    ),
    "hybrid (HSDP)": (
        "the batch; model state inside each node, replicated across nodes",
        "FSDP's messages inside a node + all-reduce of each gradient shard across nodes",
    ),
    "pipeline (GPipe)": ("the layers", "each micro-batch's activations forward, gradients back"),
    "tensor (Megatron)": ("each layer's weight matrices", "all-reduce of each layer's output"),
    "context (ring attention)": ("the sequence", "K and V blocks around a ring + gradients"),
}


def _one_step(strategy: str, global_batch: int) -> dict[str, Any]:
    """On every rank: one SGD step of `strategy` on PipeGPT, its messages counted."""
    r, n = rank(), world_size()
    model = pipe_gpt()

    def opt_of(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1)

    if strategy == "pipeline":
        info = stage_info(r, n, n, n_layers=model.config.n_layers)
        stage = split_model(model, info.stage, info.stages)
        with comm.CommLog() as log:
            train_pipeline(
                stage, info, opt_of(stage.parameters()), 1, MICROBATCHES, global_batch, SEQ_LEN
            )
        return {"sent": log.bytes_by_op().get("send", 0.0)}
    mesh = (2, n // 2) if strategy == "hybrid" else None
    shard(model, units={type(b) for b in model.layers.values()}, strategy=strategy, mesh=mesh)
    units = [unit_layout(u) for u in sharding_state(model).units]
    with comm.CommLog() as log:
        reference.train_steps(
            model,
            opt_of(model.parameters()),
            1,
            global_batch=global_batch,
            seq_len=SEQ_LEN,
            rank=r,
            world=n,
        )
    return {"sent": sum(log.bytes_by_op().values()), "units": units}


def run(cluster: Cluster | AttachedCluster) -> dict[str, Any]:
    """Measure the map on `cluster`'s N ranks; returns the rows for `table_of`.

    Each row: strategy, what it splits and sends, the formula's bytes per step summed over the
    ranks, and the measured bytes (None for the strategies not built here). HSDP needs an even
    N >= 4 (two nodes of N/2 ranks); with fewer ranks its row says so.
    """
    n = cluster.world_size
    if n < 2:
        raise ValueError(f"the map needs 2 or more ranks, this cluster has {n}: nothing is split")
    model = pipe_gpt()
    cfg = model.config
    psi = sum(p.numel() for p in model.parameters())
    global_batch = 2 * n  # two sequences per rank, two micro-batches per pipeline
    tokens = global_batch * SEQ_LEN
    rows: list[dict[str, Any]] = []

    def add(name: str, formula: float | None, measured: float | None, note: str = "") -> None:
        rows.append(
            {
                "strategy": name,
                "splits": WHAT[name][0],
                "sends": WHAT[name][1],
                "formula_bytes": formula,
                "measured_bytes": measured,
                "note": note,
            }
        )

    for name, strategy in (("data (DDP)", "none"), ("data, sharded (FSDP)", "full")):
        runs = cluster.run(_one_step, strategy, global_batch)
        step = theory.sharding_step(strategy, runs[0]["units"], n)
        add(name, n * sum(step["comm_bytes"].values()), sum(x["sent"] for x in runs))
    if n >= 4 and n % 2 == 0:
        runs = cluster.run(_one_step, "hybrid", global_batch)
        step = theory.hybrid_step("hybrid", runs[0]["units"], (2, n // 2))
        per_rank = sum(b for ops in step["comm_bytes"].values() for b in ops.values())
        add("hybrid (HSDP)", n * per_rank, sum(x["sent"] for x in runs), f"mesh (2, {n // 2})")
    else:
        add("hybrid (HSDP)", None, None, f"needs an even N >= 4 (two nodes); N = {n}")
    runs = cluster.run(_one_step, "pipeline", global_batch)
    add(
        "pipeline (GPipe)",
        theory.pipeline_step_bytes(n, tokens, cfg.dim),
        sum(x["sent"] for x in runs),
        f"{n} stages, {MICROBATCHES} micro-batches",
    )
    add(
        "tensor (Megatron)",
        theory.tensor_parallel_step_bytes(cfg.n_layers, tokens, cfg.dim, n),
        None,
        "theory only: not built here",
    )
    add(
        "context (ring attention)",
        theory.context_parallel_step_bytes(cfg.n_layers, tokens, cfg.dim, psi, n),
        None,
        "theory only: not built here",
    )
    return {
        "world_size": n,
        "psi": psi,
        "tokens": tokens,
        "dim": cfg.dim,
        "layers": cfg.n_layers,
        "rows": rows,
    }


def table_of(result: dict[str, Any]) -> str:
    """Markdown: the map, one row per strategy, measured beside the formula."""

    def cell(b: float | None) -> str:
        return "—" if b is None else format_bytes(b)

    header = ["strategy", "splits", "sends every step", "formula (all ranks)", "measured", ""]
    body = [
        [
            r["strategy"],
            r["splits"],
            r["sends"],
            cell(r["formula_bytes"]),
            cell(r["measured_bytes"]),
            r["note"],
        ]
        for r in result["rows"]
    ]
    head = (
        f"PipeGPT, Ψ = {result['psi']:,} parameters, {result['layers']} layers, width "
        f"{result['dim']}, {result['tokens']} tokens per step, N = {result['world_size']} "
        "ranks, fp32; bytes per training step summed over the ranks."
    )
    return head + "\n\n" + table(header, body)
