"""Lab 03, drawn: the wrap plans as diagrams at notebook width, the spike's memory traces
(`fsdp_lab.plots`) and its bars per phase. Imports matplotlib and torch when called, so the
text report needs neither."""

from __future__ import annotations

from typing import Any

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.tying.lab.analysis import PHASES
from fsdp_lab.tying.lab.config import SPIKE_SYSTEMS, SYSTEM_NAMES, WRAPPINGS

DIAGRAM_WIDTH_IN = 9  # the wrap diagrams are scaled down to this (a notebook column)


def short_units(units: list) -> str:
    """A plan's units for a title, runs of 4+ numbered siblings shortened:
    ``'blocks.0', …, 'blocks.11', ['tok_emb', 'head']``."""
    parts: list[list] = []
    for u in units:
        prev = parts[-1][-1] if parts else None
        if (
            isinstance(u, str)
            and isinstance(prev, str)
            and u.rpartition(".")[0] == prev.rpartition(".")[0]
            and u.rpartition(".")[2].isdigit()
            and prev.rpartition(".")[2].isdigit()
            and int(u.rpartition(".")[2]) == int(prev.rpartition(".")[2]) + 1
        ):
            parts[-1].append(u)
        else:
            parts.append([u])
    shown = [
        repr(p[0]) + ", …, " + repr(p[-1]) if len(p) >= 4 else ", ".join(map(repr, p))
        for p in parts
    ]
    return ", ".join(shown)


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

    from fsdp_lab import plots
    from fsdp_lab.diagrams import wrap_diagram
    from fsdp_lab.meta_init.meta_device import meta_device
    from fsdp_lab.models import tiny_gpt
    from fsdp_lab.tying.lab.plans import as_units

    spike = result["spike"]
    with meta_device():  # no init fills on meta: no torch._dynamo import (seconds)
        model = tiny_gpt(**spike["model"])
    figs: dict[str, Any] = {}
    for name, plan in result["plans"].items():
        title = f"{name}: units=[{short_units(plan['units'])}]"
        figs[f"wrap_{name}"] = wrap_diagram(
            model,
            units=as_units(plan["units"]),
            title=title,
            rankdir="LR",  # sibling units stacked: the picture stays a notebook column wide
            collapse_repeats=True,
            max_width_in=DIAGRAM_WIDTH_IN,
        )
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
