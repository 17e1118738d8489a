"""The plan checked against a real run: a scaled-down twin trained on real ranks here.

A twin (`models.twin_config`: the same architecture at dim 64, 4 blocks) is small enough to
train on this machine's ranks. The planner plans it; the ranks train it under the lab's memory
tracker and comm ledger (`fake_ranks.on_real_rank`, the very code a fake rank runs), and a
plain timed run gives its step time. Memory by category and bytes are compared exactly; time
as a ratio, because the planner's clock is a model: a roofline at a measured matmul rate and
ring collectives at a measured all-gather bandwidth — this machine described as a `GPU`
(`this_machine`). On a model this small, per-operator overhead that no roofline counts
dominates a step, and the ratio says how much.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from fsdp_lab.planning.planner import GPU, plan
from fsdp_lab.planning.verify import compare, fake_run

SIZE = 512  # the matmul timed: big enough for a steady rate, small enough for a second


def _rates_on_rank() -> dict[str, float]:
    """On a rank: fp32 matmul FLOP/s with this rank's share of the cores, and the all-gather
    bandwidth (bytes a rank moves per second) over the cluster's group."""
    import torch
    import torch.distributed as dist

    from fsdp_lab import comm
    from fsdp_lab.cluster import rank_threads

    with rank_threads():
        a = torch.randn(SIZE, SIZE)
        a @ a  # warm: the first call allocates
        start, repeats = time.perf_counter(), 20
        for _ in range(repeats):
            a @ a
        flops = 2 * SIZE**3 * repeats / (time.perf_counter() - start)
    n = dist.get_world_size()
    shard = torch.zeros(2**20 // 4)  # 1 MiB per rank
    full = torch.empty(n * shard.numel())
    comm.all_gather_into_tensor(full, shard)  # warm
    dist.barrier()
    start = time.perf_counter()
    for _ in range(5):
        comm.all_gather_into_tensor(full, shard)
    seconds = (time.perf_counter() - start) / 5
    return {"flops": flops, "bytes_per_s": (n - 1) / n * full.numel() * 4 / seconds}


def this_machine(cluster: Any) -> GPU:
    """This machine's ranks described as the planner's `GPU`: the slowest rank's measured
    matmul rate (at 100% efficiency: it is what was achieved) and all-gather bandwidth, both
    for links inside and between "nodes" (here one host, loopback)."""
    import psutil

    rates = cluster.run(_rates_on_rank)
    flops = min(r["flops"] for r in rates)
    bandwidth = min(r["bytes_per_s"] for r in rates)
    return GPU(
        name=f"this machine ({cluster.world_size} ranks, measured)",
        memory_gib=psutil.virtual_memory().total / 2**30 / cluster.world_size,
        bf16_tflops=flops / 1e12,  # fp32 here: the twin trains in fp32 on CPU ranks
        intra_gbytes_s=bandwidth / 1e9,
        nic_gbit_s=bandwidth * 8 / 1e9,
        efficiency=1.0,
        flops_kind="fp32 matmul (measured)",
    )


def _timed_on_rank(run: Any, steps: int) -> list[float]:
    """On a rank: the twin sharded as `run` says, `steps` steps timed, no tracker (a tracker's
    dispatch mode costs every operator)."""
    import torch

    from fsdp_lab import reference
    from fsdp_lab.cluster import rank_threads
    from fsdp_lab.planning.fake_ranks import _batch, _mesh
    from fsdp_lab.planning.models import block_classes, build_on_meta
    from fsdp_lab.sharding import shard

    torch.manual_seed(0)
    model = build_on_meta(run.model, run.seq)
    shard(model, units=block_classes(model), strategy=run.strategy, mesh=_mesh(run))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    stamps: list[float] = []
    with rank_threads():
        reference.train_steps(
            model,
            optimizer,
            steps,
            on_step=lambda _: stamps.append(time.perf_counter()),
            **_batch(run),
        )
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def twin_beside_plan(
    cluster: Any,
    model: str = "llama3-8b-twin",
    strategy: str = "zero3",
    mesh: tuple[int, int] | None = None,
    seq: int = 64,
    micro_batch: int = 2,
    steps: int = 6,
) -> dict[str, Any]:
    """The twin planned for this machine's ranks and trained on them: the plan with its
    ``verified`` filled from the real run (memory by category, bytes), and the step time
    planned and measured (the median over the steps after the first)."""
    from fsdp_lab.planning.fake_ranks import on_real_rank

    machine = this_machine(cluster)
    n = cluster.world_size
    planned = plan(
        model,
        gpus=n,
        gpus_per_node=n,
        gpu=machine,
        strategy=strategy,
        mesh=mesh,
        precision="fp32",
        seq=seq,
        micro_batch=micro_batch,
    )
    run = fake_run(planned)
    measured = cluster.run(on_real_rank, run)[0]
    per_rank = cluster.run(_timed_on_rank, run, steps)
    slowest = [max(t) for t in zip(*per_rank, strict=True)]
    step_s = statistics.median(slowest[1:])
    verified = compare(planned, measured)
    verified["how"] = f"{n} real ranks on this machine (gloo), the same measurement code"
    return {
        **planned,
        "verified": verified,
        "measured_step_time_s": step_s,
        "step_time_ratio": step_s / planned["step_time_s"],
    }
