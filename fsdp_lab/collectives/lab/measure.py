"""Lab 00, on the ranks: who holds what after each collective, then bytes, time and memory.

Bytes are counted by `fsdp_lab.comm` at the call, memory by `fsdp_lab.trace`; nothing here
compares or draws (`analysis.py`, `report.py`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from fsdp_lab import comm
from fsdp_lab.cluster import AttachedCluster, Cluster, borrow, device, rank, world_size
from fsdp_lab.collectives.lab.config import OPS, CollectivesConfig
from fsdp_lab.trace import MemoryTracker, Timeline, category


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


def measure(
    config: CollectivesConfig, cluster: Cluster | AttachedCluster | None = None
) -> dict[str, Any]:
    """Every rank's contents and measurements; `cluster` is reused if given (its size wins)."""
    with borrow(cluster, config.world_size, config.backend) as ranks:
        per_rank = ranks.run(_worker, config.numel, config.repeats)
        return {"world_size": ranks.world_size, "backend": ranks.backend, "per_rank": per_rank}
