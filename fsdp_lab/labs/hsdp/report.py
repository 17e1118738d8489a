"""Lab 06, shown: the mesh and the link each collective uses (graphviz), bytes per group and
memory per rank against the formulas, the network model's scaling picture beside the chart
commonly quoted for it; the tables the notebook and the command line print."""

from __future__ import annotations

from typing import Any

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.labs.hsdp.config import SYSTEMS
from fsdp_lab.markdown import table
from fsdp_lab.sizes import format_bytes as fb

# The chart often quoted for FSDP vs HSDP on 100 Gbit/s Ethernet: per-GPU TFLOPS at 1, 2, 4, 8
# and 16 nodes. Not a measurement of this lab — drawn beside the model to be checked against it.
QUOTED_NODES = (1, 2, 4, 8, 16)
QUOTED_TFLOPS = {"fsdp": (180, 175, 160, 130, 95), "hsdp": (180, 178, 176, 174, 172)}


def _flat(by_group: dict[str, dict[str, float]]) -> dict[str, float]:
    return {f"{g}: {op}": b for g, ops in by_group.items() for op, b in ops.items()}


def bytes_figure(result: LabResult) -> Any:
    """Rank 0's bytes per step, by system, group and op, beside the formulas."""
    from fsdp_lab import plots

    measured, theory = {}, {}
    for system in SYSTEMS:
        row = result["systems"][system]
        measured |= {f"{system} · {k}": b for k, b in _flat(row["comm_bytes_per_rank"][0]).items()}
        theory |= {f"{system} · {k}": b for k, b in _flat(row["theory_comm_bytes"]).items()}
    return plots.plot_measured_vs_theory(
        measured, theory, title="bytes per step on rank 0, by group: measured vs formula"
    )


def memory_figure(result: LabResult) -> Any:
    """Peak model state per rank, measured (bars) and the formula (line), per system."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    n = result["world_size"]
    width = 0.8 / len(SYSTEMS)
    for i, system in enumerate(SYSTEMS):
        row = result["systems"][system]
        xs = [r + (i - 1) * width for r in range(n)]
        ax.bar(
            xs,
            [b / 2**20 for b in row["peak_model_state_bytes_per_rank"]],
            width,
            label=system,
            color=f"C{i}",
        )
        ax.hlines(
            row["theory_peak_bytes"] / 2**20,
            xs[0] - width / 2,
            xs[-1] + width / 2,
            colors=f"C{i}",
            linestyles=":",
        )
    ax.set(
        xlabel="rank",
        ylabel="peak model state (MiB)",
        title="model state per rank: measured (bars), formula (dotted)",
    )
    ax.set_xticks(range(n))
    ax.legend(fontsize=8)
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


def bytes_table(result: LabResult) -> str:
    """Markdown: per system, group and op, rank 0's measured bytes per step and the formula."""
    rows = []
    for system in SYSTEMS:
        row = result["systems"][system]
        measured, theory = _flat(row["comm_bytes_per_rank"][0]), _flat(row["theory_comm_bytes"])
        for key in dict.fromkeys([*measured, *theory]):
            group, op = key.split(": ")
            rows.append([system, group, op, fb(measured.get(key, 0.0)), fb(theory.get(key, 0.0))])
    return table(["system", "group", "op", "measured/step (rank 0)", "theory"], rows)


def memory_table(result: LabResult) -> str:
    """Markdown: per system, peak model state on every rank, the formula, node NIC bytes."""
    rows = [
        [
            s,
            ", ".join(fb(b) for b in r["peak_model_state_bytes_per_rank"]),
            fb(r["theory_peak_bytes"]),
            fb(r["node_nic_bytes_per_step"]),
        ]
        for s, r in ((s, result["systems"][s]) for s in SYSTEMS)
    ]
    return table(
        ["system", "peak model state per rank", "formula", "through a node's NIC/step"], rows
    )


def scaling_table(result: LabResult) -> str:
    """Markdown: the network model's TFLOPS per GPU, FSDP and HSDP, and the quoted chart."""
    model = result["network_model"]
    quoted = {n: i for i, n in enumerate(QUOTED_NODES)}
    rows = []
    for i, n in enumerate(model["nodes"]):
        f, h = model["scaling"]["fsdp"][i], model["scaling"]["hsdp"][i]
        q = quoted.get(n)
        chart = f"{QUOTED_TFLOPS['fsdp'][q]} / {QUOTED_TFLOPS['hsdp'][q]}" if q is not None else "-"
        rows.append(
            [
                n,
                f"{f['tflops_per_gpu']:.0f}",
                f"{h['tflops_per_gpu']:.0f}",
                f"{f['comm_s']:.2f} s",
                f"{h['comm_s']:.2f} s",
                chart,
            ]
        )
    head = [
        "nodes",
        "FSDP TFLOPS/GPU",
        "HSDP TFLOPS/GPU",
        "FSDP comm/step",
        "HSDP comm/step",
        "quoted chart FSDP / HSDP",
    ]
    return assumptions(model) + "\n\n" + table(head, rows)


def assumptions(model: dict[str, Any]) -> str:
    """Markdown: the network model's inputs, as this run set them — assumed, not measured."""
    w, net = model["workload"], model["network"]
    return (
        f"Assumed, not measured: {w['parameters'] / 1e9:g}B parameters at "
        f"{w['bytes_per_parameter']:g} bytes each, {w['tokens_per_gpu']:,} tokens per GPU, "
        f"{w['tflops']:g} TFLOPS per GPU alone, overlap {w['overlap']:g}; "
        f"{net['gpus_per_node']} GPUs per node joined at {net['intra_bandwidth'] / 1e9:g} GB/s, "
        f"{net['nics_per_node']} × {net['inter_bandwidth'] * 8 / 1e9 / net['nics_per_node']:g} "
        f"Gbit/s NIC per node, shard group S = {model['shard']}."
    )


def departures(result: LabResult) -> list[str]:
    """A † line for each PyTorch twin that departs from single-process training where ours
    does not, with what is known of why."""
    lines = []
    for twin in result["pytorch_departs"]:
        why = ""
        if twin.startswith("fsdp1") and result["mesh"][1] == 1:
            why = (
                ": with one rank per shard group FSDP1 switches HYBRID_SHARD to NO_SHARD over "
                "that one rank (its warning: 'since the world size is 1') and never all-reduces "
                "across the replicas, so each replica trains on its own slice of the batch"
            )
        lines.append(
            f"- † {twin} departs from single-process training by "
            f"{result['pytorch_max_abs_diff_vs_single_process'][twin]:.2g}{why}"
        )
    return lines


def checkpoint_line(result: LabResult) -> str:
    """One line: rank files and bytes each system's sharded checkpoint wrote; lossless?"""
    cp = result["checkpoint"]
    full, hybrid = cp["full"], cp["hybrid"]
    return (
        f"- sharded checkpoint: full FSDP wrote {full['rank_files']} rank files "
        f"({fb(full['rank_file_bytes'])}), HSDP {hybrid['rank_files']} "
        f"({fb(hybrid['rank_file_bytes'])}: the first replica only); every rank reloaded it "
        f"bitwise: {full['bitwise_after_reload'] and hybrid['bitwise_after_reload']}"
    )


def emulated_line(result: LabResult) -> str:
    """The emulated two-node measurement beside the model's prediction, or why it was skipped."""
    e = result["emulated"]
    if "skipped" in e:
        return f"- emulated two-node cluster: skipped — {e['skipped']}"
    inter, intra = e["link"]["inter"], e["link"]["intra"]
    steps = "; ".join(
        f"{s}: measured {e[s]['measured_step_s'] * 1e3:.0f} ms, predicted "
        f"{e[s]['predicted_step_s'] * 1e3:.0f} ms"
        for s in ("full", "hybrid")
    )
    return (
        f"- emulated two-node cluster (veth shaped to {e['rate']}; measured "
        f"{inter['bandwidth'] * 8 / 1e6:.0f} Mbit/s and {inter['latency'] * 1e6:.0f} µs per hop "
        f"across, {intra['bandwidth'] * 8 / 1e9:.1f} Gbit/s inside; compute "
        f"{e['compute_s'] * 1e3:.0f} ms/step): {steps}"
    )


def summary(result: LabResult) -> str:
    """Markdown: agreement, bytes per group, memory, capacity, the network model, emulation."""
    r = result
    c = r["capacity"]
    versus = ", ".join(f"{t} {d:.2g}" for t, d in r["max_abs_diff_vs_pytorch"].items()) or "not run"
    ok = {s: r["systems"][s]["comm_matches_theory"] for s in SYSTEMS}
    lines = [
        f"HSDP on mesh {tuple(r['mesh'])} (R replicas x S ranks per shard group) = "
        f"{r['world_size']} ranks ({r['backend']})",
        "",
        f"- max |hybrid - single process| = {r['max_abs_diff_vs_single_process']:.3g}; "
        f"against PyTorch's HSDP on the same mesh: {versus}",
        f"- bytes equal the formulas on every rank: {ok}",
        *departures(r),
        "",
        bytes_table(r),
        "",
        memory_table(r),
        "",
        f"- capacity ({c['bytes_per_parameter']} B of model state per parameter, mixed-precision "
        f"Adam): a {c['params'] / 1e9:g}B model needs {fb(c['per_gpu_full'])} per GPU under full "
        f"FSDP over {c['gpus']} GPUs, {fb(c['per_gpu_hybrid'])} under HSDP sharded over "
        f"{c['shard_group']}; the largest model that fits {c['vram_bytes'] / 1e9:g} GB GPUs: "
        f"{c['largest_params_full'] / 1e9:.0f}B (N×VRAM) vs {c['largest_params_hybrid'] / 1e9:.0f}B (S×VRAM)",
        "",
        "### Network model (alpha-beta rings, `fsdp_lab.netsim`)",
        "",
        scaling_table(r),
        "",
        checkpoint_line(r),
        emulated_line(r),
    ]
    return "\n".join(lines)
