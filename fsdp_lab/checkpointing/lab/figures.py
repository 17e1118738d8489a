"""Lab 02, drawn: kept inputs and calls per schedule beside the formulas, memory over one
forward + backward — every figure of the lab, from its result.
"""

from __future__ import annotations

from typing import Any

from fsdp_lab.labs.contract import LabResult


def figures(result: LabResult) -> dict[str, Any]:
    """Peak bytes against calls with both frontiers, and the memory trace of each recorded run
    (stems "trace_store_all", "trace_segments_3", ...)."""
    from fsdp_lab import plots

    figs = {"memory_vs_compute": plots.plot_memory_vs_compute(result["chains"])}
    n = next(iter(result["chains"]))  # the traces are the shortest chain's table runs
    for name, trace in result["memory_traces"].items():
        figs[f"trace_{name.replace('(', '_').replace(')', '')}"] = plots.plot_memory_trace(
            trace, title=f"one forward + backward, {name} (N = {n})"
        )
    return figs
