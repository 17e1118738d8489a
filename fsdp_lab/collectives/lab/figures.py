"""Lab 00, drawn: who holds what after each collective, bytes per rank against the formulas,
the memory trace and the timeline — every figure of the lab, from its result.
"""

from __future__ import annotations

from typing import Any

from fsdp_lab.labs.contract import LabResult


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
