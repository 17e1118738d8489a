"""Lab 00, shown: who holds what per op, bytes against theory, memory and timeline; a table."""

from __future__ import annotations

from typing import Any

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.markdown import table
from fsdp_lab.sizes import format_bytes


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

    def measured(op: str) -> str:
        return ", ".join(map(format_bytes, sorted({m[op] for m in result["comm_bytes_per_rank"]})))

    rows = [
        [op, measured(op), format_bytes(formula), f"{result['time_s'][op] * 1e3:.2f} ms"]
        for op, formula in result["theory_comm_bytes"].items()
    ]
    return (
        f"world size {result['world_size']} on {result['backend']}, shard "
        f"{format_bytes(result['shard_bytes'])} per rank\n\n"
        + table(["op", "measured bytes/rank (all ranks)", "theory", "time/call"], rows)
        + f"\n\nmeasured equals theory on every rank: {result['matches_theory']}"
    )
