"""Lab 00 — the four collectives every sharding scheme is made of, run on real ranks.

    broadcast        one rank's tensor copied to all            (ZeRO / meta-init: sync states)
    all-gather       every rank's shard concatenated on all     (FSDP: unshard before use)
    reduce-scatter   sum over ranks, each keeps its own chunk   (FSDP: shard the gradients)
    all-reduce       sum over ranks, everyone keeps the whole   (DDP: average the gradients)

First on tiny tensors whose values say where they came from (who holds what, before and
after), then on a tensor of `numel` elements per rank, measured: bytes each rank moved
(counted by `fsdp_lab.comm`) beside the ring-algorithm formulas, time per call, and the
memory trace of the buffers involved.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from typing import Any

import torch

from fsdp_lab import comm
from fsdp_lab.cluster import AttachedCluster, Cluster, device, rank, world_size
from fsdp_lab.labs import LabResult
from fsdp_lab.labs.collectives_config import CollectivesConfig
from fsdp_lab.trace import MemoryTracker, Timeline, category

OPS = ("broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


def theory_bytes(op: str, shard_bytes: int, n: int) -> float:
    """Per-rank bytes of one call, from DESIGN.md's formulas, for a shard of `shard_bytes`."""
    full = shard_bytes * n  # the all-gather output / reduce-scatter input
    return {
        "broadcast": float(shard_bytes) if n > 1 else 0.0,
        "all_gather_into_tensor": (n - 1) / n * full,
        "reduce_scatter_tensor": (n - 1) / n * full,
        "all_reduce": 2 * (n - 1) / n * shard_bytes,
    }[op]


def _who_holds_what() -> dict[str, dict[str, list[float]]]:
    """Tiny tensors whose values name their origin: rank r contributes the value r + 1."""
    r, n, dev = rank(), world_size(), device()
    seen: dict[str, dict[str, list[float]]] = {}

    x = torch.full((2,), float(r + 1) if r == 0 else 0.0, device=dev)
    before = x.tolist()
    comm.broadcast(x, src=0)
    seen["broadcast"] = {"before": before, "after": x.tolist()}

    shard = torch.full((2,), float(r + 1), device=dev)
    full = torch.zeros(2 * n, device=dev)
    comm.all_gather_into_tensor(full, shard)
    seen["all_gather_into_tensor"] = {"before": shard.tolist(), "after": full.tolist()}

    # Every rank holds a whole vector [1, 2, ..., 2N] * (r + 1); chunk r of the sum stays on r.
    vec = torch.arange(1, 2 * n + 1, dtype=torch.float32, device=dev) * (r + 1)
    out = torch.zeros(2, device=dev)
    comm.reduce_scatter_tensor(out, vec)
    seen["reduce_scatter_tensor"] = {"before": vec.tolist(), "after": out.tolist()}

    y = torch.full((2,), float(r + 1), device=dev)
    before = y.tolist()
    comm.all_reduce(y)
    seen["all_reduce"] = {"before": before, "after": y.tolist()}
    return seen


def _measure(numel: int, repeats: int) -> dict[str, Any]:
    """Each op `repeats` times on `numel`-element shards, under log, timeline and tracker."""
    r, n, dev = rank(), world_size(), device()
    with comm.CommLog() as log, Timeline(rank=r) as timeline, MemoryTracker(dev, rank=r) as mem:
        with category("comm_buffers"):
            shard = torch.randn(numel, device=dev)
            full = torch.empty(numel * n, device=dev)
        mem.mark("buffers allocated")
        times: dict[str, list[float]] = {op: [] for op in OPS}
        for op in OPS:
            mem.mark(op)
            for _ in range(repeats):
                first = len(log.records)
                if op == "broadcast":
                    comm.broadcast(shard, src=0)
                elif op == "all_gather_into_tensor":
                    comm.all_gather_into_tensor(full, shard)
                elif op == "reduce_scatter_tensor":
                    comm.reduce_scatter_tensor(shard, full)
                else:
                    comm.all_reduce(shard)
                record = log.records[first]
                times[op].append(record.end - record.start)
        del shard, full
        # gloo's worker thread drops its reference to the last buffer a few ms after wait()
        # returns, and the tracker rightly counts it until then; give it up to a second.
        deadline = time.monotonic() + 1.0
        while mem.current_bytes > 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        mem.mark("buffers freed")
    per_call = {op: log.bytes_by_op()[op] / repeats for op in OPS}
    return {
        "bytes": per_call,
        "time_s": {op: statistics.median(ts) for op, ts in times.items()},
        "memory_trace": mem.trace(),
        "timeline": timeline.to_dict(),
    }


def _worker(numel: int, repeats: int) -> dict[str, Any]:
    return {"contents": _who_holds_what(), **_measure(numel, repeats)}


def run(
    config: CollectivesConfig = CollectivesConfig(),
    cluster: Cluster | AttachedCluster | None = None,
) -> LabResult:
    """Run the collectives lab; `cluster` is reused if given (its world size wins)."""
    owned = cluster is None
    if cluster is None:
        cluster = Cluster(config.world_size, config.backend)
    try:
        per_rank = cluster.run(_worker, config.numel, config.repeats)
    finally:
        if owned:
            cluster.close()
    n = cluster.world_size
    shard_bytes = config.numel * 4
    theory = {op: theory_bytes(op, shard_bytes, n) for op in OPS}
    measured = [p["bytes"] for p in per_rank]
    contents = {
        op: {stage: [p["contents"][op][stage] for p in per_rank] for stage in ("before", "after")}
        for op in OPS
    }
    # The slowest rank sets the pace of a collective.
    time_s = {op: max(p["time_s"][op] for p in per_rank) for op in OPS}
    return LabResult(
        "collectives",
        {
            "config": {**asdict(config), "world_size": n},
            "world_size": n,
            "backend": cluster.backend,
            "shard_bytes": shard_bytes,
            "contents": contents,
            "comm_bytes_per_rank": measured,
            "theory_comm_bytes": theory,
            "matches_theory": all(m[op] == theory[op] for m in measured for op in OPS),
            "time_s": time_s,
            "bus_bandwidth_GBps": {
                op: (theory[op] / t / 1e9 if t > 0 else None) for op, t in time_s.items()
            },
            "memory_traces": [p["memory_trace"] for p in per_rank],
            "timelines": [p["timeline"] for p in per_rank],
        },
    )


# ------------------------------------------------------------------------ pictures and summary


def figures(result: LabResult) -> dict[str, Any]:
    """The lab's pictures, by file stem: who holds what per op, bytes vs theory, memory, timeline."""
    from fsdp_lab import plots

    figs: dict[str, Any] = {}
    for op, stages in result["contents"].items():
        figs[f"contents_{op}"] = plots.plot_rank_contents(stages, title=f"{op}: who holds what")
    rank0 = result["comm_bytes_per_rank"][0]
    figs["bytes_vs_theory"] = plots.plot_measured_vs_theory(
        rank0, result["theory_comm_bytes"], title="bytes moved per rank per call (rank 0)"
    )
    figs["memory_trace"] = plots.plot_memory_trace(result["memory_traces"], title="live bytes")
    figs["timeline"] = plots.plot_timeline(result["timelines"], title="communication per rank")
    return figs


def summary(result: LabResult) -> str:
    """A markdown table: per op, measured bytes (every rank), theory, median time."""
    from fsdp_lab.plots import format_bytes

    lines = [
        f"world size {result['world_size']} on {result['backend']}, shard "
        f"{format_bytes(result['shard_bytes'])} per rank",
        "",
        "| op | measured bytes/rank (all ranks) | theory | time/call |",
        "|---|---|---|---|",
    ]
    for op, theory in result["theory_comm_bytes"].items():
        measured = {m[op] for m in result["comm_bytes_per_rank"]}
        shown = ", ".join(format_bytes(b) for b in sorted(measured))
        lines.append(
            f"| {op} | {shown} | {format_bytes(theory)} | {result['time_s'][op] * 1e3:.2f} ms |"
        )
    lines.append("")
    lines.append(f"measured equals theory on every rank: {result['matches_theory']}")
    return "\n".join(lines)
