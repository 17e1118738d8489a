"""Lab 02, in words and tables: a table per chain (kept inputs, calls, bytes, time, gradients),
ours vs torch, the all-gathers per checkpoint placement, the explorer's notes, and the textbook
table corrected beside the measurement (with Griewank's binomial law). The figures are in
`figures.py`.

Every sentence that compares two measurements is built here from the result, so its words
follow the numbers (tests/test_checkpoint_report.py feeds them results that go each way).
(Over 450 lines on purpose: the lab's one home for words, in the order notebook 02 says them; the
textbook's rows were a module of their own, split by output type.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fsdp_lab import measured
from fsdp_lab.checkpointing.lab.analysis import disagreements
from fsdp_lab.labs.contract import LabResult
from fsdp_lab.markdown import table
from fsdp_lab.sizes import format_bytes

Rows = Sequence[dict[str, Any]]


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
    no more than the repeats show: where the runs overlap, or the medians lie within
    `measured.MARGIN`, no order is claimed."""
    if len(rows) < 2:
        return ""
    base = rows[0]
    ref = f"`{base['schedule']}`"
    overlap, slower, faster = [], [], []

    def runs(r: dict) -> list[float]:  # the spread of the repeats, around their median
        return [r["time_min_s"], r["time_s"], r["time_max_s"]]

    for r in rows[1:]:
        name = f"`{r['schedule']}`"
        said = measured.order(runs(r), runs(base))  # the one rule of `fsdp_lab.measured`
        if said == 0:
            overlap.append(name)
        elif said > 0:
            slower.append(f"{name} {r['time_s'] / base['time_s']:.1f}×")
        else:
            faster.append(f"{name} ({r['forward_calls']} layer calls to {base['forward_calls']})")
    parts = []
    if slower:
        parts.append(f"slower than {ref}, in median time: {', '.join(slower)}")
    if overlap:
        parts.append(
            f"{', '.join(overlap)}: cannot be told apart from {ref} (runs overlapping its "
            f"{_ms(base['time_min_s'])}–{_ms(base['time_max_s'])} ms, or medians within "
            f"{measured.MARGIN:.0%})"
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


SOURCES_TABLE = table(
    ["strategy", "memory", "compute"],
    [
        ["store all", "O(N)", "O(N)"],
        ["recompute all", "O(1)", "O(N²)"],
        ["checkpoint every C layers", "O(C)", "O(N²/C)"],
        ["√N checkpointing", "O(√N)", "O(N√N), theoretically optimal"],
    ],
)


# -- the corrected table --------------------------------------------------------------------------

# (kept inputs, layer calls) as the corrected theory writes them; `theory.checkpoint_cost` counts.
FORMULAS = {
    "store_all": ("N", "N"),
    "full_recompute": ("2 — O(1)", "N(N+1)/2 — O(N²)"),
    "every": ("C + 1 — O(C)", "N²/(2C) + 3N/2 − N/C — O(N²/C)"),
    "segments": ("⌈N/k⌉ + k − 1 (− 2 if k ∤ N) — O(N/k + k)", "N + (⌈N/k⌉ − 1)·k < 2N — O(N)"),
    "optimal": ("≤ b", "the fewest for b kept inputs (DP)"),
    "revolve": (
        "s + 1 (s snapshots + the taped state)",
        "N + r·N − C(s+r, s+1), r the least with C(s+r, s) ≥ N",
    ),
}
NAMES = {
    "store_all": "store all",
    "full_recompute": "recompute all from the input",
    "every": "every(C): C checkpoints, N/C layers apart",
    "segments": "segments(k), Chen et al.: each segment rerun once",
    "optimal": "optimal(b): fewest calls for b kept inputs",
    "revolve": "revolve(s), Griewank–Walther: s snapshots",
}


def _family(row: dict[str, Any]) -> str:
    return row["schedule"].split("(")[0]


def _by_family(result: LabResult) -> dict[int, dict[str, dict[str, Any]]]:
    """N -> schedule family -> its measured row, N ascending."""
    chains = sorted(result["chains"].items(), key=lambda item: int(item[0]))
    return {int(n): {_family(r): r for r in chain["rows"]} for n, chain in chains}


def corrected_table(result: LabResult) -> str:
    """Markdown: each schedule's kept inputs and calls as formulas, beside what the lab measured
    at every N: the schedule run, kept inputs · layer calls · peak activation bytes."""
    by_n = _by_family(result)
    head = ["schedule", "kept inputs", "layer calls"]
    head += [f"N = {n}, measured: kept · calls · peak bytes" for n in by_n]
    rows = []
    for family, (kept, calls) in FORMULAS.items():
        cells = []
        for runs in by_n.values():
            r = runs.get(family)
            cells.append(
                "—"
                if r is None
                else f"`{r['schedule']}`: {r['stored_activations']} · {r['forward_calls']} · "
                f"{format_bytes(r['peak_activation_bytes'])}"
            )
        rows.append([NAMES[family], kept, calls, *cells])
    return table(head, rows)


def _listing(by_n: dict[int, dict[str, dict[str, Any]]], family: str, fmt: Any) -> str:
    return ", ".join(f"{fmt(runs[family], n)} at N = {n}" for n, runs in by_n.items())


def textbook_verdicts(result: LabResult) -> str:
    """Markdown bullets: for each textbook row that fails, the claim, the measurement, and where
    the claim fails — each verdict's words chosen by the measured numbers."""
    by_n = _by_family(result)
    ns = list(by_n)
    out = []

    per_layer = [by_n[n]["every"]["forward_calls"] / n for n in ns]
    if len(ns) > 1:
        trend = (
            "grew with N: O(N²/C) = O(N^1.5) at C = √N"
            if all(b > a for a, b in zip(per_layer, per_layer[1:], strict=False))
            else "did not grow with N in these runs"
        )
    else:
        trend = "(one N measured: no trend)"
    listing = _listing(
        by_n,
        "every",
        lambda r, n: (
            f"`{r['schedule']}` kept {r['stored_activations']} inputs for "
            f"{r['forward_calls'] / n:.2f}·N calls"
        ),
    )
    rerun_once = all(by_n[n]["segments"]["forward_calls"] < 2 * n for n in ns)
    segments = _listing(
        by_n,
        "segments",
        lambda r, n: (
            f"`{r['schedule']}` kept {r['stored_activations']} inputs for "
            f"{r['forward_calls']} calls"
        ),
    )
    out.append(
        '**"Checkpoint every C layers: O(C) memory, O(N²/C) compute" mixes two schemes.** '
        "Its memory and compute are those of *C checkpoints*, N/C layers apart, each layer "
        f"rebuilt from its nearest one (`every(C)`). Measured: {listing}; the calls per layer "
        f"{trend}. A checkpoint *every C layers* costs what its recompute makes of it: rebuilt "
        "layer by layer from the nearest checkpoint each time (`every(N/C)`), N/C + 1 inputs "
        "and O(N·C) calls; rerun once per segment, its activations kept for that segment's "
        "backward (Chen et al.'s `segments(C)`, the row below), ⌈N/C⌉ + C − 1 inputs (− 2 when C does not "
        "divide N) and "
        + ("under 2N calls" if rerun_once else "one extra forward in theory, more measured here")
        + f" — measured: {segments}."
    )

    seg = [by_n[n]["segments"]["forward_calls"] / n for n in ns]
    under = all(by_n[n]["segments"]["forward_calls"] < 2 * n for n in ns)
    listing = _listing(by_n, "segments", lambda r, n: f"`{r['schedule']}` {r['forward_calls']}")
    every_cost = _listing(
        by_n, "every", lambda r, n: f"{r['forward_calls'] / (n * n**0.5):.2f}·N√N"
    )
    compute = (
        f"under 2N calls at every N ({listing}; at most {max(seg):.2f}·N): one extra forward "
        "at most, O(N) — not O(N√N)"
        if under
        else f"not under 2N calls everywhere ({listing}): more than one extra forward"
    )
    out.append(
        '**"√N checkpointing: O(√N) memory, O(N√N) compute"** takes its memory from Chen et '
        f"al.'s segments and its compute from `every(√N)`. Measured: segments of k ≈ √N made "
        f"{compute}. The O(N√N) is `every(√N)`'s: {every_cost}."
    )

    fewer = [n for n in ns if _calls(by_n, n, "optimal") < _calls(by_n, n, "segments")]
    same = [n for n in ns if _calls(by_n, n, "optimal") == _calls(by_n, n, "segments")]
    pairs = _listing(
        by_n,
        "segments",
        lambda r, n: f"{by_n[n]['optimal']['forward_calls']} vs {r['forward_calls']}",
    )
    if fewer:
        verdict = (
            f'**"Theoretically optimal" is wrong**: keeping as many inputs as segments(k), '
            f"`optimal(b)` made fewer calls at N = {_join(fewer)} (optimal vs segments: {pairs})"
        )
        if same:
            verdict += f"; at N = {_join(same)} segments(k) happened to be optimal too"
    else:
        verdict = (
            f'**"Theoretically optimal"**: in these runs `optimal(b)`, keeping as many inputs, '
            f"made no fewer calls than segments(k) ({pairs}): the chains are too short to show "
            "the difference"
        )
    out.append(verdict + ".")
    return "\n".join(f"- {line}" for line in out)


def _calls(by_n: dict[int, dict[str, dict[str, Any]]], n: int, family: str) -> int:
    return by_n[n][family]["forward_calls"]


def _join(ns: Sequence[int]) -> str:
    return ", ".join(str(n) for n in ns)


def frontier_in_bytes(result: LabResult) -> str:
    """The frontier is optimal in kept inputs, not in bytes: optimal(b) against segments(k) and
    revolve(b - 1), which keep as many inputs, compared in calls and in measured bytes."""
    by_n = _by_family(result)
    lines = []
    for n, runs in by_n.items():
        opt = runs["optimal"]
        for other in ("segments", "revolve"):
            r = runs.get(other)
            if r is None or r["stored_activations"] != opt["stored_activations"]:
                continue
            calls = _word(opt["forward_calls"], r["forward_calls"], "fewer", "more", "as many")
            held = _word(
                opt["peak_activation_bytes"], r["peak_activation_bytes"], "less", "more", "as much"
            )
            lines.append(
                f"N = {n}: `{opt['schedule']}` and `{r['schedule']}` both kept "
                f"{opt['stored_activations']} inputs; `{opt['schedule']}` made {calls} calls "
                f"({opt['forward_calls']} vs {r['forward_calls']}) and held {held} activation "
                f"memory ({format_bytes(opt['peak_activation_bytes'])} vs "
                f"{format_bytes(r['peak_activation_bytes'])})"
            )
    return "\n".join(f"- {line}" for line in lines)


def _word(a: float, b: float, less: str, more: str, same: str) -> str:
    return less if a < b else more if a > b else same


# -- Griewank's binomial law --------------------------------------------------------------------


def binomial_table(result: LabResult) -> str:
    """Markdown: per snapshots s and repetitions r, the law's longest chain l = C(s+r, s), and
    revolve(s) measured on l and on l + 1 layers: advances and the most advances of one layer,
    each with the closed form in parentheses."""
    head = [
        "s snapshots",
        "r",
        "l = C(s+r, s)",
        "on l layers: advances (law) · most per layer (law)",
        "on l + 1 layers: most per layer (law)",
    ]
    rows = []
    for row in result["binomial_law"]:
        at, past = row["at"], row["past"]
        rows.append(
            [row["snapshots"], row["repetitions"], at["steps"]]
            + [
                f"{at['advances']} ({at['theory_advances']}) · "
                f"{at['repetitions']} ({at['theory_repetitions']})"
            ]
            + [f"{past['repetitions']} ({past['theory_repetitions']})"]
        )
    return table(head, rows)


def binomial_note(result: LabResult) -> str:
    """Whether the measured repetitions follow the law: r on l = C(s+r, s) layers, r + 1 on one
    more; and whether the advances equal t = r·l − C(s+r, s+1)."""
    rows = result["binomial_law"]
    reach = all(
        r["at"]["repetitions"] == r["repetitions"] and r["past"]["repetitions"] > r["repetitions"]
        for r in rows
    )
    advances = all(r["at"]["advances"] == r["at"]["theory_advances"] for r in rows)
    first = (
        f"In all {len(rows)} cases the hooks saw the law: on l = C(s+r, s) layers no layer was "
        "advanced more than r times, and one layer more needed r + 1"
        if reach
        else "The hooks did not see the law everywhere: compare the columns above"
    )
    second = (
        "and the advances equal Griewank–Walther's t = r·l − C(s+r, s+1)"
        if advances
        else "but the advances differ from t = r·l − C(s+r, s+1) somewhere"
    )
    return f"{first}; {second}."


def theory_table(ns: Sequence[int]) -> str:
    """Markdown, theory only (`theory.checkpoint_cost`, no run): every(C) against segments(k)
    at C = k = round(√N) for chains longer than a notebook runs."""
    from fsdp_lab import theory  # the schedules import torch
    from fsdp_lab.checkpointing import schedules

    rows = []
    for n in ns:
        root = round(n**0.5)
        every = theory.checkpoint_cost(schedules.every(root), n)
        seg = theory.checkpoint_cost(schedules.segments(root), n)
        rows.append(
            [
                n,
                root,
                every.stored_activations,
                every.forward_calls,
                f"{every.forward_calls / n:.2f}",
            ]
            + [seg.stored_activations, seg.forward_calls, f"{seg.forward_calls / n:.2f}"]
        )
    head = ["N", "C = k", "every: kept", "every: calls", "calls / N"]
    return table([*head, "segments: kept", "segments: calls", "calls / N"], rows)
