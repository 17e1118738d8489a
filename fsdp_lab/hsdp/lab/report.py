"""Lab 06, in words: bytes per group and memory per rank against the formulas, the network
model's scaling beside the chart commonly quoted for it, the emulated nodes — every table and
paragraph the notebook and the command line print, built from the result. The figures are in
`figures.py`.
"""

from __future__ import annotations

from typing import Any

from fsdp_lab.hsdp.lab.config import SYSTEMS
from fsdp_lab.labs.contract import LabResult
from fsdp_lab.markdown import max_diff, table
from fsdp_lab.sizes import format_bytes as fb

# The chart often quoted for FSDP vs HSDP on 100 Gbit/s Ethernet: per-GPU TFLOPS at 1, 2, 4, 8
# and 16 nodes. Not a measurement of this lab — drawn beside the model to be checked against it.
QUOTED_NODES = (1, 2, 4, 8, 16)
QUOTED_TFLOPS = {"fsdp": (180, 175, 160, 130, 95), "hsdp": (180, 178, 176, 174, 172)}


def flat_bytes(by_group: dict[str, dict[str, float]]) -> dict[str, float]:
    """{group: {op: bytes}} as {"group: op": bytes}."""
    return {f"{g}: {op}": b for g, ops in by_group.items() for op, b in ops.items()}


def bytes_table(result: LabResult) -> str:
    """Markdown: per system, group and op, rank 0's measured bytes per step and the formula."""
    rows = []
    for system in SYSTEMS:
        row = result["systems"][system]
        measured, theory = (
            flat_bytes(row["comm_bytes_per_rank"][0]),
            flat_bytes(row["theory_comm_bytes"]),
        )
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
        "- "
        + max_diff("hybrid", "single process", r["max_abs_diff_vs_single_process"])
        + f"; against PyTorch's HSDP on the same mesh: {versus}",
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


# -- the notebook's paragraphs: every number from the result -----------------------------------


def agreement_text(result: LabResult) -> str:
    """Markdown: agreement with one process and with PyTorch's HSDP, and the bytes verdicts."""
    diffs = ", ".join(f"{k} {v:.1e}" for k, v in result["max_abs_diff_vs_pytorch"].items())
    matches = ", ".join(
        f"{s}: {'yes' if r['comm_matches_theory'] else '**no**'}"
        for s, r in result["systems"].items()
    )
    return (
        max_diff("hybrid", "single process", result["max_abs_diff_vs_single_process"])
        + f"; max |ours − PyTorch's HSDP on the same mesh|: {diffs or 'not run'}. Bytes equal "
        f"the formulas on every rank — {matches}."
    )


def bytes_paragraph(result: LabResult) -> str:
    """Markdown: rank 0's all-gather and all-reduce bytes per step, full FSDP against HSDP, and
    what crosses one node's NIC."""
    full, hybrid = result["systems"]["full"], result["systems"]["hybrid"]
    ag_full = full["comm_bytes_per_rank"][0]["world"]["all_gather_into_tensor"]
    ag_hybrid = hybrid["comm_bytes_per_rank"][0]["shard"]["all_gather_into_tensor"]
    ar = hybrid["comm_bytes_per_rank"][0].get("replicate", {}).get("all_reduce", 0.0)
    r, s = result["mesh"]
    n = r * s
    return (
        f"Per rank and step, full FSDP all-gathered **{fb(ag_full)}** over all {n} ranks "
        f"((N−1)/N = {(n - 1) / n:.2f} of the parameters, twice); HSDP all-gathered "
        f"**{fb(ag_hybrid)}** inside its node ((S−1)/S = {(s - 1) / s:.2f}, twice) and "
        f"all-reduced **{fb(ar)}** of gradient shard across nodes — 2(R−1)/R · Ψb/S, the term "
        "a formula of HSDP without its all-reduce leaves out. What would cross one node's NIC "
        f"per step (a ring leaves each node once): full FSDP "
        f"**{fb(full['node_nic_bytes_per_step'])}**, HSDP **{fb(hybrid['node_nic_bytes_per_step'])}**."
    )


def _in_units(extra: float, units: list[dict[str, Any]]) -> str:
    """`extra` bytes as whole units of the run (the root, blocks), if it is; else in bytes."""
    size = {u["name"]: u["padded_numel"] * u["element_size"] for u in units}
    root = size.get("root", 0)
    block = max((b for name, b in size.items() if name != "root"), default=0)
    for with_root in (0, 1):
        for k in range(4):
            if with_root * root + k * block == extra and (with_root or k):
                parts = (["the root unit (" + fb(root) + ")"] if with_root else []) + (
                    [
                        f"{k} more block{'s' if k > 1 else ''} ({fb(block)}{' each' if k > 1 else ''})"
                    ]
                    if k
                    else []
                )
                return " and ".join(parts)
    own = sum(u["shard_numel"] * u["element_size"] for u in units)
    if extra == own:
        return "the rank's own parameter shard (4Ψ/S), kept as storage of its own"
    return f"{fb(extra)}, not a whole number of the run's units"


def memory_paragraph(result: LabResult) -> str:
    """Markdown: what each system's measured peak holds beyond its formula (in units of the
    run), then the capacity a real model would need — assumed, as the config says."""
    lines = []
    for system in SYSTEMS:
        row = result["systems"][system]
        extra = max(row["peak_model_state_bytes_per_rank"]) - row["theory_peak_bytes"]
        if extra > 0:
            lines.append(
                f"{system}: {fb(extra)} above its formula — {_in_units(extra, row['units'])}, "
                "beside what the formula counts"
            )
        else:
            lines.append(f"{system}: at or under its formula ({fb(-extra)} under)")
    c = result["capacity"]
    capacity = (
        f"For a real model (assumed: mixed-precision Adam, {c['bytes_per_parameter']} bytes of "
        f"model state per parameter), a {c['params'] / 1e9:g}B model needs "
        f"**{fb(c['per_gpu_full'])}** per GPU under full FSDP over {c['gpus']} GPUs but "
        f"**{fb(c['per_gpu_hybrid'])}** under HSDP sharded over a node of {c['shard_group']}. The "
        f"largest model {c['vram_bytes'] / 1e9:g} GB GPUs can hold: "
        f"**{c['largest_params_full'] / 1e9:.0f}B** with full FSDP (N×VRAM) against "
        f"**{c['largest_params_hybrid'] / 1e9:.0f}B** with HSDP (S×VRAM) — before activations."
    )
    return "Measured peaks: " + "; ".join(lines) + ".\n\n" + capacity


AHEAD = 1.10  # "HSDP well above FSDP": more than 10 % more TFLOPS per GPU


def scaling_paragraph(result: LabResult) -> str:
    """Markdown: where the network model and the quoted chart agree and where they do not —
    each judged from the two sets of numbers, node count by node count."""
    model = result["network_model"]
    f = {row["nodes"]: row for row in model["scaling"]["fsdp"]}
    h = {row["nodes"]: row for row in model["scaling"]["hsdp"]}
    chart = {
        n: (QUOTED_TFLOPS["fsdp"][i], QUOTED_TFLOPS["hsdp"][i]) for i, n in enumerate(QUOTED_NODES)
    }
    both = [n for n in QUOTED_NODES if n in f]
    ahead = {
        n: (
            chart[n][1] > AHEAD * chart[n][0],
            h[n]["tflops_per_gpu"] > AHEAD * f[n]["tflops_per_gpu"],
        )
        for n in both
    }
    agree = [n for n in both if ahead[n][0] and ahead[n][1]]
    apart = [n for n in both if n > 1 and ahead[n][0] != ahead[n][1]]
    one = both[0]
    same_at_one = abs(f[one]["tflops_per_gpu"] - h[one]["tflops_per_gpu"]) < 1 and (
        chart[one][0] == chart[one][1]
    )
    parts = []
    if same_at_one:
        parts.append(
            f"one node is the same for both ({chart[one][0]} TFLOPS in the chart, "
            f"{f[one]['tflops_per_gpu']:.0f} in the model: everything on NVLink, hidden behind "
            "compute)"
        )
    if agree:
        parts.append(
            f"both put HSDP more than {AHEAD - 1:.0%} above FSDP at {_nodes(agree)} "
            + "("
            + "; ".join(
                f"{n}: chart {chart[n][1]} vs {chart[n][0]}, model "
                f"{h[n]['tflops_per_gpu']:.0f} vs {f[n]['tflops_per_gpu']:.0f}"
                for n in agree
            )
            + ")"
        )
    text = "**Where the arithmetic and the chart agree:** " + (
        "; ".join(parts) if parts else "nowhere beyond one node"
    )
    text += "."
    if apart:
        text += (
            f" They part at {_nodes(apart)}: "
            + "; ".join(
                f"at {n} nodes the chart has HSDP {chart[n][1]} vs FSDP {chart[n][0]}, the model "
                f"{h[n]['tflops_per_gpu']:.0f} vs {f[n]['tflops_per_gpu']:.0f}"
                for n in apart
            )
            + "."
        )
    last = both[-1]
    drop_2 = f[1]["tflops_per_gpu"] - f[2]["tflops_per_gpu"]
    drop_rest = f[2]["tflops_per_gpu"] - f[last]["tflops_per_gpu"]
    far = max(f)
    text += (
        "\n\n**Where the chart's shape does not follow from the arithmetic:** FSDP's bytes "
        f"through a NIC are 3(N−1)/N·Ψb — already at 2 nodes "
        f"{f[2]['node_nic_bytes'] / f[far]['node_nic_bytes']:.0%} of what they are at {far} "
        f"nodes. So the model's FSDP falls **at once**, by {drop_2:.0f} TFLOPS from 1 to 2 nodes "
        f"(the chart: {chart[1][0] - chart[2][0]}), and then by {drop_rest:.0f} from 2 to "
        f"{last} nodes, as the latency terms grow (the chart: {chart[2][0] - chart[last][0]}). "
        f"HSDP's all-reduce across nodes is 2(R−1)/R·Ψb: it grows with the node count "
        f"({fb(h[2]['node_nic_bytes'])} at 2 nodes, {fb(h[last]['node_nic_bytes'])} at {last}), "
        f"so once it outgrows the compute it hides behind, HSDP falls too — "
        f"{h[2]['tflops_per_gpu']:.0f} → {h[last]['tflops_per_gpu']:.0f} TFLOPS from 2 to "
        f"{last} nodes in the model, {h[far]['tflops_per_gpu']:.0f} at {far} — where the chart "
        f"goes from {chart[2][1]} to {chart[last][1]}. A chart of measured runs can differ from "
        "a model (NCCL's tree algorithms, several NICs per node, larger batches hiding more); "
        "the bytes alone do not give the chart's shapes."
    )
    return text


def _nodes(counts: list[int]) -> str:
    return ", ".join(str(n) for n in counts) + (" nodes" if counts else "")


def emulated_paragraph(result: LabResult) -> str:
    """Markdown: the emulated two-node cluster's link, and full FSDP against HSDP on it,
    measured beside the model's prediction (or why it was skipped)."""
    e = result["emulated"]
    if "skipped" in e:
        return f"Emulated two-node cluster skipped: {e['skipped']}"
    inter, intra = e["link"]["inter"], e["link"]["intra"]
    lines = [
        f"Link across nodes: {inter['bandwidth'] * 8 / 1e6:.0f} Mbit/s (shaped to {e['rate']}), "
        f"{inter['latency'] * 1e6:.0f} µs per hop; inside a node: "
        f"{intra['bandwidth'] * 8 / 1e9:.1f} Gbit/s, {intra['latency'] * 1e6:.0f} µs. Link probes: "
        f"an all-reduce of {fb(e['probe_bytes'])} and one of 4 B; model: TinyGPT with "
        f"{e['full']['parameters']:,} parameters; compute alone {e['compute_s'] * 1e3:.0f} ms per "
        "step.",
        "",
        table(
            [
                "system",
                "measured ms/step",
                "model ms/step",
                "of which communication",
                "link bytes/step",
            ],
            [
                [
                    s,
                    f"{e[s]['measured_step_s'] * 1e3:.0f}",
                    f"{e[s]['predicted_step_s'] * 1e3:.0f}",
                    f"{e[s]['predicted_comm_s'] * 1e3:.0f}",
                    fb(e[s]["predicted_node_nic_bytes"]),
                ]
                for s in ("full", "hybrid")
            ],
        ),
        "",
    ]
    measured = e["full"]["measured_step_s"] / e["hybrid"]["measured_step_s"]
    predicted = e["full"]["predicted_step_s"] / e["hybrid"]["predicted_step_s"]
    lines.append(
        f"On this link full FSDP's step took **{measured:.2f}×** HSDP's; the model says "
        f"**{predicted:.2f}×**. Where the two differ, the model's simplifications show: gloo's "
        "reduce-scatter and all-gather are not all rings, the ranks share this machine's cores "
        "(the compute time is measured under the same sharing, the copies and reductions of the "
        "collectives are not), and a step's per-message costs are counted from a 4-byte probe."
    )
    return "\n".join(lines)
