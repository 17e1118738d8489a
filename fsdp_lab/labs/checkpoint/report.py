"""Lab 02, shown: a table per chain (bytes, calls, kept inputs, time, gradients), ours vs torch,
the all-gathers per checkpoint placement; memory against compute, and one forward + backward."""

from __future__ import annotations

from typing import Any

from fsdp_lab.labs.checkpoint.analysis import disagreements
from fsdp_lab.labs.contract import LabResult
from fsdp_lab.markdown import table
from fsdp_lab.sizes import format_bytes


def figures(result: LabResult) -> dict[str, Any]:
    """Peak bytes against calls with the frontier, and the memory trace of each recorded run
    (stems "trace_store_all", "trace_segments_3", ...)."""
    from fsdp_lab import plots

    figs = {"memory_vs_compute": plots.plot_memory_vs_compute(result["chains"])}
    for name, trace in result["memory_traces"].items():
        figs[f"trace_{name.replace('(', '_').replace(')', '')}"] = plots.plot_memory_trace(
            trace, title=f"one forward + backward, {name}"
        )
    return figs


def schedule_table(rows: list[dict[str, Any]], against: str = "") -> str:
    """Markdown: per measured schedule, peak activation bytes, calls and kept inputs with their
    theory, time, and the largest gradient difference (from store_all's, or `against`'s)."""
    head = ["schedule", "peak activations", "calls (theory)", "kept (theory)", "time"]
    return table(
        [*head, f"max grad diff{against}"],
        (
            [r["schedule"], format_bytes(r["peak_activation_bytes"])]
            + [f"{r['forward_calls']} ({r['theory_forward_calls']})"]
            + [f"{r['stored_activations']} ({r['theory_stored_activations']})"]
            + [f"{r['time_s'] * 1e3:.1f} ms", f"{r['max_abs_grad_diff']:.1e}"]
            for r in rows
        ),
    )


def summary(result: LabResult) -> str:
    """Markdown: per N, every schedule measured with its theory in parentheses; the ZeRO-3
    all-gathers per mode; then whether every count agreed with its theory."""
    lines = []
    for n, chain in result["chains"].items():
        lines += [f"### N = {n}", "", schedule_table(chain["rows"])]
        v = chain["versus_torch"]
        lines += [
            "",
            f"segments of {v['k']}: ours {format_bytes(v['ours_peak_activation_bytes'])} vs "
            f"torch.utils.checkpoint {format_bytes(v['torch_peak_activation_bytes'])} "
            f"(ratio {v['peak_ratio_ours_to_torch']:.3f}), "
            f"max grad diff {v['max_abs_grad_diff_ours_vs_torch']:.1e}",
            "",
        ]
    if result["with_sharding"]:
        rows = [
            [mode, f"{s['all_gather_calls_per_step']:g} ({s['theory_all_gather_calls_per_step']})"]
            + [format_bytes(s["all_gather_bytes_per_step"])]
            for mode, s in result["with_sharding"].items()
        ]
        head = ["mode", "all-gathers/step (counted)", "bytes/step"]
        lines += ["### ZeRO-3 chain with checkpointing", "", table(head, rows), ""]
    off = disagreements(result.data)
    lines.append("every count equals its theory" if not off else "differs from the theory:")
    lines += [f"- {line}" for line in off]
    return "\n".join(lines)
