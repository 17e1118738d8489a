"""Lab 03, shown: the wrap plans as diagrams, the spike's traces and bars; the summary with the
audit's table and the spike's verdicts, every number from the result."""

from __future__ import annotations

from typing import Any

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.labs.tying.analysis import PHASES
from fsdp_lab.labs.tying.config import SPIKE_SYSTEMS, WRAPPINGS
from fsdp_lab.markdown import table
from fsdp_lab.sizes import format_bytes

SYSTEM_NAMES = {"fsdp_lab": "fsdp_lab shard", "fsdp2": "FSDP2 fully_shard"}


def audit_table(rows: list[dict]) -> str:
    """A markdown table of `audit.audit_worker`'s rows (one rank's list)."""
    columns = ("system", "accepted", "stage", "still_tied", "equal_values", "error")
    return table(columns, ([row[c] for c in columns] for row in rows))


def verdict(root: int, joint: int) -> str:
    """Which wrapping held more bytes, and by how much."""
    if root == joint:
        return f"equal ({format_bytes(root)})"
    higher = "root unit" if root > joint else "joint unit"
    return (
        f"{higher} higher by {format_bytes(abs(root - joint))} "
        f"(root {format_bytes(root)}, joint {format_bytes(joint)})"
    )


def spike_bars(spike: dict[str, Any]) -> Any:
    """Rank 0's phases per system, root unit beside joint unit."""
    from matplotlib.figure import Figure

    systems = [s for s in SPIKE_SYSTEMS if s in spike]
    fig = Figure(figsize=(6.5 * len(systems), 4), layout="constrained")
    for ax, system in zip(fig.subplots(1, len(systems), squeeze=False)[0], systems, strict=True):
        for j, (w, color) in enumerate(zip(WRAPPINGS, ("#C44E52", "#4C72B0"), strict=True)):
            heights = [spike[system][w][k][0] / 2**20 for k in PHASES]
            bars = ax.bar(
                [i + 0.4 * j for i in range(len(PHASES))], heights, 0.4, label=w, color=color
            )
            ax.bar_label(bars, [f"{h:.1f}" for h in heights], fontsize=7)
        names = [
            p.replace("the blocks", "blocks").replace("most while", "most while\n")
            for p in PHASES.values()
        ]
        ax.set_xticks([i + 0.2 for i in range(len(PHASES))], names, fontsize=8)
        ax.set_ylabel("MiB (rank 0)")
        ax.set_title(SYSTEM_NAMES[system], fontsize=10)
        ax.legend(fontsize=8)
    return fig


def figures(result: LabResult) -> dict[str, Any]:
    """Matplotlib figures (memory traces, spike bars) and `Diagram`s (the wrap plans)."""
    import torch

    from fsdp_lab import plots
    from fsdp_lab.diagrams import wrap_diagram
    from fsdp_lab.labs.tying.plans import as_units
    from fsdp_lab.models import tiny_gpt

    spike = result["spike"]
    with torch.device("meta"):
        model = tiny_gpt(**spike["model"])
    figs: dict[str, Any] = {}
    for name, plan in result["plans"].items():
        title = f"{name}: units={plan['units']}"
        figs[f"wrap_{name}"] = wrap_diagram(model, units=as_units(plan["units"]), title=title)
    for system in SPIKE_SYSTEMS:
        if system not in spike:
            continue
        panels = [(w, tr) for w in WRAPPINGS for tr in spike[system][w]["traces"]]
        fig = plots.plot_memory_trace(
            [tr for _, tr in panels],
            title=f"{SYSTEM_NAMES[system]}: tied pair in the root unit vs a joint unit",
        )
        for ax, (w, tr) in zip(fig.axes, panels, strict=False):  # axes first, in panel order
            ax.set_title(f"{w.replace('_', ' ')} · rank {tr['rank']}", fontsize=10)
        figs[f"spike_{system}"] = fig
    figs["spike_bytes"] = spike_bars(spike)
    return figs


def summary(result: LabResult) -> str:
    """Markdown: ties, plans, verification, to_empty, the audit's table, the spike's verdicts."""
    lines = [f"weight tying on {result['world_size']} ranks ({result['backend']})", ""]
    for spec, ties in result["ties"].items():
        found = "; ".join(f"{' = '.join(t['names'])} ({t['kind']})" for t in ties) or "none"
        lines.append(f"- ties of {spec}: {found}")
    for name, plan in result["plans"].items():
        lines.append(f"- plan {name}: {'valid' if plan['valid'] else 'refused'}")
    model, split = result["model"], result["tie_plans"]["split_tie"][0]
    for name, v in result["verification"].items():
        problems = sum(len(p) for p in v["right_after_shard"] + v["after_steps"])
        lines.append(
            f"- shard {model} with {name}: {problems} tie problems after shard and after "
            f"{v['steps']} steps; "
            f"max |ours - single process| = {v['max_abs_diff_vs_single_process']:.2g}"
        )
    te, r0 = result["to_empty"], result["to_empty"]["per_rank"][0]
    spike = result["spike"]
    lines += [
        f"- to_empty on torch {te['torch']}: tied after to_empty {te['tied_after_to_empty']}, "
        f"after retie {te['tied_after_retie']}; shard refused the untied model: "
        f"{r0['shard_refused']}; accepted after retie: {r0['shard_accepted_after_retie']}",
        "",
        f"### Live audit of {model}: {split} in its own unit, its tied partner in the root",
        "",
        audit_table(result["audit"]),
        "",
        f"### Root-unit spike (tied matrix {format_bytes(spike['tied_matrix_bytes'])})",
        "",
    ]
    for system in SPIKE_SYSTEMS:
        if system not in spike:
            continue
        name = SYSTEM_NAMES[system]
        for key, phase in PHASES.items():
            root, joint = (spike[system][w][key][0] for w in WRAPPINGS)
            lines.append(f"- {name}, {phase} (rank 0): {verdict(root, joint)}")
        where = "; ".join(
            f"{w.replace('_', ' ')} between markers "
            + " and ".join(repr(m) for m in spike[system][w]["peak_between"][0])
            for w in WRAPPINGS
        )
        lines.append(f"- {name}, where the peak is (rank 0): {where}")
    return "\n".join(lines)
