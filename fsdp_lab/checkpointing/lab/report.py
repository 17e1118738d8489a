"""Lab 02, shown: a table per chain (kept inputs, calls, bytes, time, gradients), ours vs
torch, the all-gathers per checkpoint placement, the explorer's notes; memory against compute,
and one forward + backward over time. (The textbook table corrected and Griewank's binomial
law: `textbook.py`.)

Every sentence that compares two measurements is built here (or in `textbook.py`) from the
result, so its words follow the numbers (tests/test_checkpoint_report.py feeds them results
that go each way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fsdp_lab.checkpointing.lab.analysis import disagreements
from fsdp_lab.checkpointing.lab.textbook import binomial_table
from fsdp_lab.labs.contract import LabResult
from fsdp_lab.markdown import table
from fsdp_lab.sizes import format_bytes

Rows = Sequence[dict[str, Any]]


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


# -- the measured table ------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def schedule_table(rows: Rows, against: str = "") -> str:
    """Markdown: per measured schedule, kept inputs and calls with their theory, the peak of
    activations and of everything tracked (the dashed line of its memory trace: activations +
    gradients), the measured time (median and range of its repeats), and the largest gradient
    difference (from store_all's, or `against`'s)."""
    repeats = rows[0].get("repeats", 1) if rows else 1
    head = [
        "schedule",
        "kept (theory)",
        "calls (theory)",
        "peak activations",
        "peak activations + gradients",
        f"time (measured), ms: median [min–max] of {repeats} runs",
        f"max grad diff{against}",
    ]
    return table(
        head,
        (
            [r["schedule"]]
            + [f"{r['stored_activations']} ({r['theory_stored_activations']})"]
            + [f"{r['forward_calls']} ({r['theory_forward_calls']})"]
            + [format_bytes(r["peak_activation_bytes"]), format_bytes(r["peak_total_bytes"])]
            + [f"{_ms(r['time_s'])} [{_ms(r['time_min_s'])}–{_ms(r['time_max_s'])}]"]
            + [f"{r['max_abs_grad_diff']:.1e}"]
            for r in rows
        ),
    )


def timing_note(rows: Rows) -> str:
    """Each schedule's measured time against the first row's (store_all), in words that claim
    no more than the repeats show: where the ranges of the runs overlap, no order is claimed."""
    if len(rows) < 2:
        return ""
    base = rows[0]
    ref = f"`{base['schedule']}`"
    overlap, slower, faster = [], [], []
    for r in rows[1:]:
        name = f"`{r['schedule']}`"
        if r["time_min_s"] <= base["time_max_s"] and base["time_min_s"] <= r["time_max_s"]:
            overlap.append(name)
        elif r["time_s"] > base["time_s"]:
            slower.append(f"{name} {r['time_s'] / base['time_s']:.1f}×")
        else:
            faster.append(f"{name} ({r['forward_calls']} layer calls to {base['forward_calls']})")
    parts = []
    if slower:
        parts.append(f"slower than {ref}, in median time: {', '.join(slower)}")
    if overlap:
        parts.append(
            f"{', '.join(overlap)}: cannot be told apart from {ref}, their runs overlap its "
            f"{_ms(base['time_min_s'])}–{_ms(base['time_max_s'])} ms"
        )
    if faster:
        parts.append(
            f"measured *faster* than {ref}: {', '.join(faster)} — on layers this small, time "
            "is mostly per-call overhead and noise"
        )
    return f"Time, measured (wall-clock, median of repeats, no tracker) — {'; '.join(parts)}."


def activation_growth(result: LabResult) -> str:
    """Store-all's measured peak in (batch, dim) fp32 tensors per N, and what each layer adds."""
    config = result["config"]
    tensor = config["batch"] * config["dim"] * 4
    peaks = {
        int(n): s["store_all"]["peak_activation_bytes"] for n, s in result["schedules"].items()
    }
    rows = [[n, format_bytes(p), f"{p / tensor:.2f}"] for n, p in peaks.items()]
    text = table(["N", "store_all peak activations", "in (batch, dim) tensors"], rows)
    if len(peaks) < 2:
        return text
    (n0, p0), (n1, p1) = sorted(peaks.items())[0], sorted(peaks.items())[-1]
    per_layer = (p1 - p0) / (n1 - n0) / tensor
    rest = p0 / tensor - per_layer * n0
    words = (
        "two, as the theory says: its input and its GELU input"
        if round(per_layer, 2) == 2
        else "not the two the theory expects (its input and its GELU input)"
    )
    return (
        f"{text}\n\nOne (batch, dim) fp32 tensor is {format_bytes(tensor)}. From N = {n0} to "
        f"N = {n1}, each extra layer adds {per_layer:.2f} tensors — {words}; on top sit "
        f"{rest:.2f} tensors whatever the depth."
    )


def regime_sentence(result: LabResult) -> str:
    """Whether this run's activations or its weights are the larger, from its config: the
    regime every later sentence about activation memory is printed in."""
    config = result["config"]
    act, weights = config["batch"] * config["dim"], config["dim"] * config["dim"] + config["dim"]
    if act > weights:
        return (
            f"In this run each activation tensor ({config['batch']} × {config['dim']} = "
            f"{act:,} values) is larger than a layer's weights and bias ({weights:,}): as in a "
            "transformer, whose batch × sequence tokens outnumber the hidden size, activations, "
            "not weights, dominate — what checkpointing saves."
        )
    return (
        f"In this run a layer's weights and bias ({weights:,} values) are at least as large as "
        f"each activation tensor ({config['batch']} × {config['dim']} = {act:,}): activations "
        "do not dominate here, so checkpointing (which saves activations only) saves little of "
        "the peak, and the weights' gradients weigh as much as what it saves."
    )


def gradient_note(result: LabResult) -> str:
    """Whether every schedule's gradients equal store-all's, from the measured differences."""
    rows = [r for chain in result["chains"].values() for r in chain["rows"]]
    largest = max(r["max_abs_grad_diff"] for r in rows)
    if largest == 0:
        return (
            f"All {len(rows)} runs computed **the same gradients as store-all, bit for bit** "
            "(largest difference 0): recomputing a deterministic layer from the same input "
            "gives the same tensors, so checkpointing changed memory and time, not the result."
        )
    worst = max(rows, key=lambda r: r["max_abs_grad_diff"])
    return (
        f"Not every run matched store-all bit for bit: the largest gradient difference is "
        f"{largest:.1e} (N = {worst['n']}, `{worst['schedule']}`)."
    )


def chain_tables(result: LabResult) -> str:
    """Markdown: per N, the schedule table and what its measured times do and do not show."""
    lines = []
    for n, chain in result["chains"].items():
        lines += [
            f"#### N = {n}",
            "",
            schedule_table(chain["rows"]),
            "",
            timing_note(chain["rows"]),
        ]
        lines.append("")
    return "\n".join(lines)


def counts_note(result: LabResult) -> str:
    """Whether every count (calls, kept inputs, advances, all-gathers) equals its theory."""
    off = disagreements(result.data)
    if not off:
        return "Every count equals its theory."
    return "\n".join(["These counts differ from their theory:", *(f"- {line}" for line in off)])


def summary(result: LabResult) -> str:
    """Markdown: per N, every schedule measured with its theory in parentheses; the binomial
    law; the ZeRO-3 all-gathers per mode; then whether every count agreed with its theory."""
    lines = [chain_tables(result)]
    lines += ["### ours vs torch.utils.checkpoint", "", versus_torch_table(result), ""]
    if result.data.get("binomial_law"):
        lines += ["### revolve(s): Griewank's binomial law", "", binomial_table(result), ""]
    if result["with_sharding"]:
        lines += ["### ZeRO-3 chain with checkpointing", "", sharding_table(result), ""]
    lines.append(counts_note(result))
    return "\n".join(lines)


def traces_table(result: LabResult) -> str:
    """Markdown: each recorded run's two peaks, read from the recording drawn beside it."""
    rows = [
        [name, format_bytes(max(trace["bytes"]["activations"])), format_bytes(trace["peak_bytes"])]
        for name, trace in result["memory_traces"].items()
    ]
    head = ["run", "peak activations (red band)", "peak activations + gradients (dashed line)"]
    return table(head, rows)


# -- ours vs torch.utils.checkpoint, and sharding ------------------------------------------------


def versus_torch_table(result: LabResult) -> str:
    """Markdown: per N, the peak bytes (activations and the gradients flowing between layers)
    of store-all, our checkpoint and torch's on the same segments, and their gradients."""
    rows = []
    for n, chain in result["chains"].items():
        v = chain["versus_torch"]
        rows.append(
            [n, v["k"]]
            + [format_bytes(v[f"{who}_peak_activation_bytes"]) for who in ("store_all", "ours")]
            + [format_bytes(v["torch_peak_activation_bytes"])]
            + [
                f"{v['peak_ratio_ours_to_torch']:.3f}",
                f"{v['max_abs_grad_diff_ours_vs_torch']:.1e}",
            ]
        )
    head = ["N", "k", "store-all peak", "ours peak", "torch peak", "ours / torch", "grad diff"]
    return table(head, rows)


def versus_torch_note(result: LabResult) -> str:
    """Same peak and gradients as torch's, or where not; and how store-all here compares with
    store-all in the schedule table (the recompute inside backward mixes in its gradients)."""
    chains = result["chains"]
    ratios = [c["versus_torch"]["peak_ratio_ours_to_torch"] for c in chains.values()]
    diffs = [c["versus_torch"]["max_abs_grad_diff_ours_vs_torch"] for c in chains.values()]
    bytes_ = (
        "the same peak bytes as torch's at every N"
        if all(r == 1 for r in ratios)
        else f"between {min(ratios):.3f} and {max(ratios):.3f}× torch's peak bytes"
    )
    grads = (
        "the same gradients, bit for bit"
        if all(d == 0 for d in diffs)
        else f"gradients within {max(diffs):.1e} of torch's"
    )
    higher = [
        n
        for n, c in chains.items()
        if c["versus_torch"]["store_all_peak_activation_bytes"]
        > result["schedules"][n]["store_all"]["peak_activation_bytes"]
    ]
    where = (
        f"store-all reads higher here than in the schedule table at N = {', '.join(higher)}: "
        "this "
        "column also holds the gradients passed from layer to layer"
        if higher
        else "store-all reads no higher here than in the schedule table"
    )
    return f"Our `checkpoint` held {bytes_}, with {grads}; {where}."


def sharding_table(result: LabResult) -> str:
    rows = [
        [mode, f"{s['all_gather_calls_per_step']:g} ({s['theory_all_gather_calls_per_step']})"]
        + [format_bytes(s["all_gather_bytes_per_step"]), f"{s['max_abs_param_diff_vs_plain']:.1e}"]
        for mode, s in result["with_sharding"].items()
    ]
    head = ["mode", "all-gathers/step (theory)", "bytes/step", "max abs param diff vs plain"]
    return table(head, rows)


def sharding_note(result: LabResult) -> str:
    """Same training or not, and how each checkpoint placement's all-gathers compare with
    plain ZeRO-3's — from the counts."""
    runs = result["with_sharding"]
    plain = runs["plain"]["all_gather_calls_per_step"]
    same = all(s["max_abs_param_diff_vs_plain"] == 0 for s in runs.values())
    parts = [
        "The three trainings ended with the same parameters, bit for bit"
        if same
        else "The trainings did not end with identical parameters (see the last column)"
    ]
    for mode, s in runs.items():
        if mode == "plain":
            continue
        extra = s["all_gather_calls_per_step"] - plain
        parts.append(
            f"`{mode}` made {extra:g} more all-gathers per step than `plain`"
            if extra > 0
            else f"`{mode}` made as many all-gathers as `plain`"
            if extra == 0
            else f"`{mode}` made {-extra:g} fewer all-gathers per step than `plain`"
        )
    return "; ".join(parts) + "."


# -- the explorer ---------------------------------------------------------------------------------


def explorer_note(rows: Rows) -> str:
    """Below the explorer's table: the chosen schedule against store_all (first row) in bytes
    and calls, which column is which line of the figures, and the measured times."""
    lines = []
    if len(rows) > 1:
        base, r = rows[0], rows[1]
        ratio = r["peak_activation_bytes"] / base["peak_activation_bytes"]
        calls = r["forward_calls"] / base["forward_calls"]
        held = "less" if ratio < 1 else "more" if ratio > 1 else "as much"
        lines.append(
            f"`{r['schedule']}` held {held} activation memory than `{base['schedule']}` "
            f"({ratio:.2f}×) for {calls:.2f}× its layer calls."
        )
    lines.append(
        "In each figure, *peak activations* is the tallest the red band gets on its own, and "
        "*peak activations + gradients* the top of the whole stack, the dashed line: both come "
        "from the one recorded run drawn there. The "
        "figures' time axis is wall-clock *under the memory tracker*, which stops at every "
        "allocation: read their shapes and heights, not their lengths."
    )
    note = timing_note(rows)
    if note:
        lines.append(note)
    return "\n\n".join(lines)
