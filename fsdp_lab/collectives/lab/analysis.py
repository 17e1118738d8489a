"""Lab 00, the verdicts: measured bytes against the ring formulas, contents regrouped by op."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fsdp_lab import theory
from fsdp_lab.collectives.lab.config import OPS, CollectivesConfig


def analyse(config: CollectivesConfig, measured: dict[str, Any]) -> dict[str, Any]:
    """The ranks' raw measurements -> the lab's result (JSON types only)."""
    per_rank, n = measured["per_rank"], measured["world_size"]
    shard_bytes = config.numel * 4
    expected = {op: theory.collective_bytes(op, shard_bytes, n) for op in OPS}
    bytes_per_rank = [p["bytes"] for p in per_rank]
    contents = {
        op: {stage: [p["contents"][op][stage] for p in per_rank] for stage in ("before", "after")}
        for op in OPS
    }
    # The slowest rank sets the pace of a collective.
    time_s = {op: max(p["time_s"][op] for p in per_rank) for op in OPS}
    return {
        "config": {**asdict(config), "world_size": n},
        "world_size": n,
        "backend": measured["backend"],
        "shard_bytes": shard_bytes,
        "contents": contents,
        "comm_bytes_per_rank": bytes_per_rank,
        "theory_comm_bytes": expected,
        "matches_theory": all(m[op] == expected[op] for m in bytes_per_rank for op in OPS),
        "time_s": time_s,
        "bus_bandwidth_GBps": {
            op: (expected[op] / t / 1e9 if t > 0 else None) for op, t in time_s.items()
        },
        "memory_traces": [p["memory_trace"] for p in per_rank],
        "timelines": [p["timeline"] for p in per_rank],
    }
