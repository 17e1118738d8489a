"""Lab 01, drawn: the memory trace with its formula, bytes per collective against theory, the
timeline, and the walkthrough's stages — every figure of the lab, from its result.
"""

from __future__ import annotations

import math
from typing import Any

from fsdp_lab.labs.contract import LabResult


def figures(result: LabResult) -> dict[str, Any]:
    """The lab's pictures, by file stem: memory trace, bytes vs theory, timeline."""
    from fsdp_lab import plots

    return {
        "memory_trace": plots.plot_memory_trace(
            result["memory_traces"],
            title=f"{result['strategy']} on {result['world_size']} ranks",
            theory={"model-state formula": result["theory_peak_bytes"]},
            compare="model_state",  # the formula counts model state: set it beside the same
        ),
        "bytes_vs_theory": plots.plot_measured_vs_theory(
            result["comm_bytes_per_rank"][0],
            result["theory_comm_bytes"],
            title="bytes per step per collective (rank 0)",
        ),
        "timeline": plots.plot_timeline(result["timelines"], title="compute and communication"),
    }


def stage_figure(walk: dict[str, Any], stage: str) -> Any:
    """The picture of one stage of `walkthrough.run`: what every rank holds after it (flatten,
    free: before too)."""
    from fsdp_lab import plots

    stage_data = walk["stages"][stage]
    panels = {f"after {stage}": stage_data["rows"]}
    if stage == "flatten":  # the separate parameters, a blank cell between two of them
        rows = [sum(([*p, math.nan] for p in params), [])[:-1] for params in walk["parameters"]]
        names = " | ".join(walk["layout"]["names"])
        panels = {f"parameters {names}": rows, **panels}
    if stage == "free":  # the gathered parameters, then what is left; storage bytes measured
        before, after = (
            ", ".join(str(b) for b in walk["stages"][s]["unsharded_storage_bytes"])
            for s in ("compute", "free")
        )
        panels = {
            f"before free (unsharded storage: {before} B)": walk["stages"]["gather"]["rows"],
            f"after free (unsharded storage: {after} B)": stage_data["rows"],
        }
    return plots.plot_rank_contents(panels, title=f"{stage}: {stage_data['explanation']}")
