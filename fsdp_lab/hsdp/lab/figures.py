"""Lab 06, drawn: the mesh and the link each collective uses, bytes per group, memory per rank
against the formulas, and the scaling model — every figure of the lab, from its result.
"""

from __future__ import annotations

from typing import Any

from fsdp_lab.hsdp.lab.config import SYSTEMS
from fsdp_lab.hsdp.lab.report import QUOTED_NODES, QUOTED_TFLOPS, flat_bytes
from fsdp_lab.labs.contract import LabResult
from fsdp_lab.sizes import format_bytes as fb


def bytes_figure(result: LabResult) -> Any:
    """Rank 0's bytes per step, by system, group and op, beside the formulas."""
    from fsdp_lab import plots

    measured, theory = {}, {}
    for system in SYSTEMS:
        row = result["systems"][system]
        measured |= {
            f"{system} · {k}": b for k, b in flat_bytes(row["comm_bytes_per_rank"][0]).items()
        }
        theory |= {f"{system} · {k}": b for k, b in flat_bytes(row["theory_comm_bytes"]).items()}
    return plots.plot_measured_vs_theory(
        measured, theory, title="bytes per step on rank 0, by group: measured vs formula"
    )


def memory_figure(result: LabResult) -> Any:
    """Peak model state per rank, measured (bars) and the formula (dotted), per system, in the
    workbench's system colours; the legend beside the axes, naming the formula lines too."""
    from matplotlib.figure import Figure

    from fsdp_lab.plots import SYSTEM_COLORS

    fig = Figure(figsize=(9, 4), layout="constrained")
    ax = fig.subplots()
    n = result["world_size"]
    width = 0.8 / len(SYSTEMS)
    for i, system in enumerate(SYSTEMS):
        row, color = result["systems"][system], SYSTEM_COLORS[system]
        xs = [r + (i - 1) * width for r in range(n)]
        peaks = [b / 2**20 for b in row["peak_model_state_bytes_per_rank"]]
        ax.bar(xs, peaks, width, label=f"{system}, measured", color=color)
        ax.hlines(
            row["theory_peak_bytes"] / 2**20,
            xs[0] - width / 2,
            xs[-1] + width / 2,
            colors=color,
            linestyles=":",
            zorder=3,  # over the bars
            label=f"{system}, formula {fb(row['theory_peak_bytes'])}",
        )
    ax.set(xlabel="rank", ylabel="peak model state (MiB)", title="model state per rank")
    ax.set_xticks(range(n))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def scaling_figure(result: LabResult) -> Any:
    """The network model's scaling picture of the run's settings (`draw_scaling`)."""
    return draw_scaling(result["network_model"])


def draw_scaling(model: dict[str, Any]) -> Any:
    """Per-GPU TFLOPS and inter-node bytes vs nodes, FSDP and HSDP, from one
    `analysis.network_model`, with the quoted chart's points beside."""
    from matplotlib.figure import Figure

    nodes = model["nodes"]
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    tput, nic = fig.subplots(1, 2)
    for system, color in (("fsdp", "#C44E52"), ("hsdp", "#4C72B0")):
        rows = model["scaling"][system]
        tput.plot(
            nodes,
            [r["tflops_per_gpu"] for r in rows],
            "o-",
            color=color,
            label=f"{system.upper()}: model",
        )
        tput.plot(
            QUOTED_NODES,
            QUOTED_TFLOPS[system],
            "x--",
            color=color,
            alpha=0.6,
            label=f"{system.upper()}: quoted chart",
        )
        nic.plot(
            nodes,
            [r["node_nic_bytes"] / 1e9 for r in rows],
            "o-",
            color=color,
            label=system.upper(),
        )
    w, net = model["workload"], model["network"]
    tput.set(
        xscale="log",
        xlabel="nodes",
        ylabel="TFLOPS per GPU",
        title=f"{w['parameters'] / 1e9:.3g}B params, {net['inter_bandwidth'] * 8 / 1e9:g} Gbit/s between nodes, overlap {w['overlap']:g}, HSDP S = {model['shard']}",
    )
    nic.set(
        xscale="log",
        xlabel="nodes",
        ylabel="GB per step through a node's NICs",
        title="inter-node bytes per node and step",
    )
    for ax in (tput, nic):
        ax.set_xticks(nodes, [str(n) for n in nodes])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def figures(result: LabResult) -> dict[str, Any]:
    """The mesh diagram, bytes per group, memory per rank, the scaling picture — by file stem."""
    from fsdp_lab.diagrams import mesh_diagram

    return {
        "mesh": mesh_diagram(tuple(result["mesh"]), result["comm_bytes_per_rank"][0]),
        "bytes_per_group": bytes_figure(result),
        "memory": memory_figure(result),
        "scaling": scaling_figure(result),
    }
