"""Lab 01, shown: the memory trace with its formula, bytes per collective against theory, the
timeline; markdown tables of agreement, of what fills the model-state peak, of ZeRO-1 two ways;
and the pictures of the one-unit walkthrough (`walkthrough.py`), stage by stage.
"""

from __future__ import annotations

import math
from typing import Any

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.labs.shard.analysis import MODEL_STATE, model_state_bytes
from fsdp_lab.markdown import table
from fsdp_lab.sizes import format_bytes


def figures(result: LabResult) -> dict[str, Any]:
    """The lab's pictures, by file stem: memory trace, bytes vs theory, timeline."""
    from fsdp_lab import plots

    return {
        "memory_trace": plots.plot_memory_trace(
            result["memory_traces"],
            title=f"{result['strategy']} on {result['world_size']} ranks",
            theory={"DESIGN.md formula": result["theory_peak_bytes"]},
        ),
        "bytes_vs_theory": plots.plot_measured_vs_theory(
            result["comm_bytes_per_rank"][0],
            result["theory_comm_bytes"],
            title="bytes per step per collective (rank 0)",
        ),
        "timeline": plots.plot_timeline(result["timelines"], title="compute and communication"),
    }


def summary(result: LabResult) -> str:
    """Markdown: agreement with one process and FSDP2, peaks and bytes per collective beside
    their formulas (and DDP + ShardedOptimizer, when it was measured)."""
    lines = [
        f"strategy {result['strategy']} on {result['world_size']} ranks ({result['backend']})",
        "",
        f"- max |ours - single process| = {result['max_abs_diff_vs_single_process']:.3g}",
    ]
    if result["max_abs_diff_vs_fsdp2"] is not None:
        lines.append(f"- max |ours - FSDP2| = {result['max_abs_diff_vs_fsdp2']:.3g}")
        lines.append(
            f"- step time: ours {result['step_time_s'] * 1e3:.1f} ms, "
            f"FSDP2 {result['fsdp2_step_time_s'] * 1e3:.1f} ms"
        )
    peaks = ", ".join(format_bytes(b) for b in result["peak_model_state_bytes_per_rank"])
    lines += [
        f"- peak model state per rank: {peaks} (formula {format_bytes(result['theory_peak_bytes'])})",
        "",
        table(
            ["collective", "measured bytes/step (rank 0)", "theory", "calls/step"],
            (
                [op, format_bytes(result["comm_bytes_per_rank"][0].get(op, 0.0))]
                + [format_bytes(t), f"{result['calls_per_step'].get(op, 0):g}"]
                for op, t in result["theory_comm_bytes"].items()
            ),
        ),
    ]
    lines.append(f"\nmeasured equals theory on every rank: {result['comm_matches_theory']}")
    so = result.data.get("sharded_optimizer")
    if so:
        lines += [
            "",
            "DDP + ShardedOptimizer (ZeRO-1 as an optimizer):",
            "",
            f"- max |it - single process| = {so['max_abs_diff_vs_single_process']:.3g}",
            f"- max |it - shard(strategy='optimizer')| = "
            f"{so['max_abs_diff_vs_zero1_transformation']:.3g}",
        ]
        if so["max_abs_diff_vs_zero_redundancy_optimizer"] is not None:
            lines.append(
                f"- max |it - PyTorch's ZeroRedundancyOptimizer| = "
                f"{so['max_abs_diff_vs_zero_redundancy_optimizer']:.3g}"
            )
        share = so["theory"]["largest_share_over_even_split"]
        lines += [f"- busiest rank's share of the state / even split: {share:.3f}", ""]
        lines.append(sharded_optimizer_table(result))
    return "\n".join(lines)


def sharded_optimizer_table(result: LabResult) -> str:
    """Markdown: ZeRO-1 two ways, measured — `shard(strategy="optimizer")` and DDP +
    `ShardedOptimizer` — optimizer state per rank and bytes per step, with their formulas."""
    so = result["sharded_optimizer"]
    th = so["theory"]
    state = [
        [r, so["owned_numel_per_rank"][r], format_bytes(measured)]
        + [format_bytes(th["optimizer_state_bytes_per_rank"][r])]
        + [format_bytes(th["optimizer_state_bytes_even_split"])]
        + [format_bytes(result["optimizer_state_bytes_per_rank"][r])]
        for r, measured in enumerate(so["optimizer_state_bytes_per_rank"])
    ]
    columns = [  # rank 0, measured and formula, for each of the two
        result["comm_bytes_per_rank"][0],
        result["theory_comm_bytes"],
        so["comm_bytes_per_rank"][0],
        th["comm_bytes"],
    ]
    ops = [
        [op] + [format_bytes(c[op]) if op in c else "-" for c in columns]
        for op in (*result["theory_comm_bytes"], *th["comm_bytes"])
    ]
    ops.append(["total"] + [format_bytes(sum(c.values())) for c in columns])
    opt = "shard(strategy='optimizer')"
    return "\n".join([
        table(["rank", "elements owned (ShardedOptimizer)", "optimizer state: ShardedOptimizer",
               "formula K·Ψ_r", "even split K·Ψ/N", opt], state),
        "",
        table(["collective", opt, "formula", "DDP + ShardedOptimizer", "formula"], ops),
        "\nDDP + ShardedOptimizer bytes equal their formula on every rank: "
        f"{so['comm_matches_theory']}",
    ])  # fmt: skip


def peak_table(results: dict[str, Any], rank: int = 0) -> str:
    """Markdown: per run (lab results by label), the categories at the moment the model state
    peaked on `rank`, the formula, and the last marker before that moment."""
    rows = []
    for label, result in results.items():
        trace = result["memory_traces"][rank]
        totals = model_state_bytes(trace)
        i = max(range(len(totals)), key=totals.__getitem__)
        parts = [format_bytes(trace["bytes"][c][i]) for c in MODEL_STATE]
        before = [m["label"] for m in trace["markers"] if m["t"] <= trace["t"][i]][-1:] or ["-"]
        peak = [format_bytes(result["theory_peak_bytes"]), format_bytes(totals[i])]
        rows.append([label, *peak, *parts, before[0]])
    return table(["run", "formula", "measured", *MODEL_STATE, "last event before"], rows)


# -- the one-unit walkthrough ------------------------------------------------------------------


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


def stage_table(walk: dict[str, Any]) -> str:
    """Markdown: per stage, rank 0's unsharded storage bytes and bytes moved (all measured)."""
    head = ["stage", "elements held (rank 0)", "unsharded storage (rank 0)", "bytes moved (rank 0)"]
    return table(
        head,
        (
            [name, len(s["rows"][0]), f"{s['unsharded_storage_bytes'][0]} B"]
            + [f"{s['comm_bytes'][0]:g} B"]
            for name, s in walk["stages"].items()
        ),
    )
