"""Lab 04, said: every sentence that compares two measurements or sets a claim beside one,
built here from the result so that the words follow the numbers (a faster approach on one run,
a slower one on the next, is said as measured); every table, with a verdict or without; the
summary. The figures are in `figures.py`.

(Over 450 lines on purpose: the lab's one home for words and tables, in the order notebook 04
says them; it was three modules split by output type.)
"""

from __future__ import annotations

import math
from typing import Any

from fsdp_lab import measured, theory
from fsdp_lab.labs.contract import LabResult
from fsdp_lab.markdown import table
from fsdp_lab.meta_init.lab.config import APPROACHES, CONTROL, MODES, PARENT_INIT, RECIPE
from fsdp_lab.sizes import format_bytes as fb

GPU_BYTES = 80 * 2**30  # the memory of one 80 GiB GPU (H100, A100 80GB): model state must fit
STAGES = {  # theory.zero_table's keys, as the table's columns name them
    "none": "DDP 16Ψ",
    "optimizer": "ZeRO-1 8Ψ+8Ψ/N",
    "grad_op": "ZeRO-2 4Ψ+12Ψ/N",
    "full": "ZeRO-3 16Ψ/N",
}


def _names(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _s(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds < 1 else f"{seconds:.2f} s"


def compare_times(a: str, ta: float, b: str, tb: float) -> str:
    """A clause: `a` was so many times faster than `b`, or about the same (the one rule,
    `fsdp_lab.measured.order`; one run each, so the margin decides)."""
    if max(ta, tb) <= 0 or measured.order([ta], [tb]) == 0:
        return f"{a} and {b} took about the same time ({_s(ta)} vs {_s(tb)}, within {measured.MARGIN:.0%})"
    fast, slow, tf, ts = (a, b, ta, tb) if ta < tb else (b, a, tb, ta)
    ratio = f"{ts / tf:.1f}×" if tf > 0 else "far"
    return f"{fast} was {ratio} faster than {slow} ({_s(tf)} vs {_s(ts)})"


def _times(first: float, second: float) -> str:
    """`first` / `second` as "3.2×" or "1,250×" ("—" when `second` is not positive)."""
    if second <= 0:
        return "—"
    ratio = first / second
    return f"{ratio:.1f}×" if ratio < 100 else f"{ratio:,.0f}×"


# -- 1. shapes without storage: Llama-3-70B on meta ----------------------------------------------


def seventy_b_text(result: LabResult) -> str:
    """The 70B build: what the meta model has, both builds' time and memory, and what they say —
    the memory against the parameters' bytes, the first build against the second."""
    s = result["seventy_b"]
    if not s:
        return "*Llama-3-70B on meta was not measured in this run (`measure_70b=False`).*"
    m, first, second = s["summary"], s, s["second_build"]
    builds = table(
        ["build", "time", "resident memory growth"],
        [
            ["first, in a fresh process", _s(first["build_time_s"]), fb(first["rss_growth_bytes"])],
            ["second, same process", _s(second["build_time_s"]), fb(second["rss_growth_bytes"])],
        ],
    )
    shape = meta_summary_table(m)
    grew, weights = first["rss_growth_bytes"], m["parameter_bytes"]
    if grew <= 0:
        memory = "The first build's resident memory did not grow measurably"
    elif grew < weights:
        memory = f"The first build's resident memory grew by {fb(grew)}, {_times(weights, grew)} "
        memory += f"less than the {fb(weights)} its parameters would take"
    else:
        memory = f"The first build's resident memory grew by {fb(grew)}, no less than the "
        memory += f"{fb(weights)} of its parameters: something was allocated"
    t1, t2 = first["build_time_s"], second["build_time_s"]
    if measured.order([t1], [t2]) == 0:
        order = (
            f"the two builds took about the same time ({_s(t1)} vs {_s(t2)}): what a process pays "
            "once did not show above the noise in this run"
        )
    elif t1 > t2:
        order = (
            f"the first build took {_times(t1, t2)} as long as the second ({_s(t1)} vs {_s(t2)}): "
            "it also pays what a process pays only once (`benchmarks/bench_meta_init.py` breaks "
            "that down); the second is the model's own cost, module and Parameter objects"
        )
    else:
        order = (
            f"the second build was slower than the first here ({_s(t2)} vs {_s(t1)}): what a "
            "process pays once did not show above the machine's noise in this run"
        )
    return f"{shape}\n\n{builds}\n\n{memory}; {order}."


def model_state_table(result: LabResult, gpu_bytes: float = GPU_BYTES) -> str:
    """The measured 70B parameter count's fp32-Adam model state per rank, per ZeRO stage and
    ranks N (`theory.zero_table`), and which of those fit in `gpu_bytes` (model state alone)."""
    s = result["seventy_b"]
    if not s:
        return "*Llama-3-70B was not measured in this run: no parameter count to cost.*"
    costs, psi = s["per_rank_model_state_bytes"], s["summary"]["parameters"]
    head = ["ranks N", *STAGES.values(), "parameters alone, sharded 4Ψ/N"]
    rows = [[n, *(fb(c[k]) for k in (*STAGES, "parameters_sharded"))] for n, c in costs.items()]
    fits = [
        (STAGES[k].split()[0], n) for n, c in costs.items() for k in STAGES if c[k] <= gpu_bytes
    ]
    if len(fits) == len(costs) * len(STAGES):
        verdict = "Every cell of the rows above fits"
    elif fits:
        by_stage: dict[str, list[str]] = {}
        for stage, n in fits:
            by_stage.setdefault(stage, []).append(n)
        said = [f"{stage} at N = {_names(ns)}" for stage, ns in by_stage.items()]
        verdict = f"Of the rows above, only {_names(said)} fit"
    else:
        verdict = "None of the rows above fits"
    whole = theory.zero_table(psi, 1)["parameters_replicated"]
    return (
        f"Ψ = {psi:,} parameters, as counted on the meta model:\n\n"
        + table(head, rows)
        + f"\n\n{verdict} in one {gpu_bytes / 2**30:g} GiB GPU's memory (model state alone: "
        "activations and the gathered unit come on top). And a rank that built the model the "
        f"ordinary way would hold all {fb(whole)} of its parameters before sharding anything."
    )


# -- 2. and 3. the host-memory picture, the peaks per rank ------------------------------------


def _above(measured: float, reference: float) -> str:
    """'1.20 MiB above', '300 B below' or 'exactly'."""
    if measured == reference:
        return "exactly"
    return f"{fb(abs(measured - reference))} {'above' if measured > reference else 'below'}"


def memory_text(memory: dict[str, Any]) -> str:
    """What the host-memory picture says, rank by rank, from its numbers: the ordinary build's
    resident peak against the whole model, each meta build's against it, the tensor peaks
    against the theory lines, the resident peaks against the tensor peaks (the allocator's
    slack), and what every rank kept after the trim against model / N."""
    modes, full = memory["modes"], memory["full_model_bytes"]
    n = len(modes["ordinary"]["peak_bytes"])
    share, buffers = full / n, memory["buffer_bytes"]
    lines = []
    for r in range(n):
        ordinary = modes["ordinary"]["rss_growth_bytes"][r]
        said = [f"the ordinary build rose to {fb(ordinary)} ({ordinary / full:.2f}× the model)"]
        for mode in ("meta_param_init_fn", "meta_shard_init"):
            grew = modes[mode]["rss_growth_bytes"][r]
            if grew < ordinary:
                said.append(f"{MODES[mode]} to {fb(grew)} ({_times(ordinary, grew)} less)")
            else:
                said.append(f"{MODES[mode]} to {fb(grew)}, **not lower** than the ordinary build")
        lines.append(f"- **rank {r}**, resident memory at its peak: " + "; ".join(said) + ".")
    tensor = [
        f"{MODES[mode]} {_above(modes[mode]['peak_bytes'][0], memory['theory_peak_bytes'][mode])}"
        for mode in MODES
    ]
    lines.append(
        f"- **tensor bytes** (rank 0's peak, counted by the tracker) against the theory lines, "
        f"which leave out the buffers ({fb(buffers)} of rotary cache) and the shards' padding: "
        + "; ".join(tensor)
        + "."
    )
    slack = [
        f"{MODES[mode]} {_above(modes[mode]['rss_growth_bytes'][0], modes[mode]['peak_bytes'][0])}"
        for mode in MODES
    ]
    lines.append(
        "- **resident memory against tensor bytes** (rank 0's peaks): " + "; ".join(slack) + ". "
        "Above: pages the C allocator kept after the tensors in them were freed. Below: the "
        "peak fell between two samples of the sampler, or allocated pages were never all "
        "touched at once."
    )
    trimmed = [v for mode in MODES for v in modes[mode]["rss_after_trim_bytes"]]
    low, high = min(trimmed), max(trimmed)
    lines.append(
        f"- **after `malloc_trim`** every rank, every mode held between {fb(low)} and {fb(high)}: "
        f"{low / share:.2f}× to {high / share:.2f}× its shards (model / N = {fb(share)})."
    )
    return "\n".join(lines)


def peak_text(result: LabResult) -> str:
    """Each rank's peak tensor bytes during the unit-by-unit `shard`, beside its theory and the
    whole model: whether any rank held as much as the whole model."""
    m, full = result["materialise"], result["full_model_bytes"]
    expected = m["theory_peak_bytes"]["meta_param_init_fn"]
    peaks = result["peak_bytes_per_rank"]
    rows = [[r, fb(p), f"{_above(p, expected)} the theory", f"{p / full:.2f}×"]
            for r, p in enumerate(peaks)]  # fmt: skip
    head = ["rank", "peak tensor bytes", f"vs model / N + largest unit ({fb(expected)})"]
    text = table([*head, f"of the whole model ({fb(full)})"], rows)
    over = [str(r) for r, p in enumerate(peaks) if p >= full]
    if over:
        return text + f"\n\nRank {_names(over)} held as much as the whole model."
    highest = max(peaks) / full
    return (
        text
        + f"\n\nEvery rank's peak stayed below the whole model: the highest is {highest:.2f}× it."
    )


def buffers_table(result: LabResult) -> str:
    """Per size and approach: the buffers bitwise equal to an ordinary build's, or not."""
    rows = result["agreement"]["rows"]
    text = table(
        ["parameters", *APPROACHES],
        ([fb(row["parameter_bytes"]), *(row[a]["buffers_equal_to_ordinary"] for a in APPROACHES)]
         for row in rows),
    )  # fmt: skip
    wrong = [f"{a} at {fb(row['parameter_bytes'])}" for row in rows for a in APPROACHES
             if not row[a]["buffers_equal_to_ordinary"]]  # fmt: skip
    if wrong:
        return text + f"\n\nThe buffers differ from an ordinary build's for {_names(wrong)}."
    return text + "\n\nEvery size, both approaches: the buffers equal an ordinary build's bitwise."


def ties_table(result: LabResult) -> str:
    """Per rank and path: the tie on meta, after `shard`, the values; then whether any broke."""
    rows, broken = [], []
    for r, ties in enumerate(result["ties"]):
        for path in ("param_init_fn", "shard_init"):
            t = ties[path]
            rows.append([r, path, t["tied_on_meta"], t["problems_after_shard"] or "none"]
                        + [t["output_equals_embedding"]])  # fmt: skip
            if t["problems_after_shard"] or not t["output_equals_embedding"]:
                broken.append(f"rank {r} ({path})")
    head = ["rank", "path", "tied on meta", "problems after shard", "output == embedding"]
    text = table(head, rows)
    if broken:
        return text + f"\n\nThe tie did **not** survive on {_names(broken)}."
    return text + "\n\nOn every rank the tie survived `shard`, both ways."


def to_empty_text(result: LabResult) -> str:
    """`to_empty` on a tied meta model, then `shard`: did the tie survive, did `shard` refuse."""
    rows = [[r, t["to_empty"]["tied_after_to_empty"], t["to_empty"]["shard_refused"]]
            for r, t in enumerate(result["ties"])]  # fmt: skip
    text = table(["rank", "tied after to_empty", "shard refused"], rows)
    refused = all(r[2] for r in rows)
    error = result["ties"][0]["to_empty"]["shard_error"]
    if refused:
        return text + f"\n\n`shard` refused on every rank; rank 0's message:\n\n```\n{error}\n```"
    accepted = [str(r[0]) for r in rows if not r[2]]
    return text + f"\n\n`shard` **accepted** the untied model on rank {_names(accepted)}."


# -- 4. making the ranks agree -------------------------------------------------------------------


def kaiming_text(k: dict[str, Any]) -> str:
    """``kaiming_uniform_`` run on a shard, measured: which shards equal their own rows of the
    full init, which equal its first rows, the column shard's bound; DeterministicInit beside."""
    n = k["world_size"]
    rows = [[r, k["row_shards_equal_own_rows"][r], k["row_shards_equal_first_rows"][r]]
            + [f"{k['row_shards_max_abs_diff'][r]:.3g}"] for r in range(n)]  # fmt: skip
    head = ["rank", "= its own rows", "= the first rows", "max abs(shard − own rows)"]
    own = [str(r) for r in range(n) if k["row_shards_equal_own_rows"][r]]
    first = [str(r) for r in range(n) if k["row_shards_equal_first_rows"][r]]
    if len(own) == n:
        rows_said = "every row shard equals its own rows of the full init"
    else:
        who = f"only rank {_names(own)}'s" if own else "no rank's"
        rows_said = f"{who} row shard equals its own rows of the full init"
    if len(first) == n:
        rows_said += ", and every one equals the *first* rows: the stream restarts on each rank"
    ratio, root = k["bound_column_shard"] / k["bound_full"], math.sqrt(n)
    is_root = "= √N" if math.isclose(ratio, root, rel_tol=1e-6) else f"≠ √N = {root:.3f}"
    det = "equal" if k["deterministic_slices_equal_full"] else "do **not** equal"
    return (
        f"Weight {tuple(k['shape'])} in row shards over {n} ranks, each seeded alike:\n\n"
        + table(head, rows)
        + f"\n\nSo {rows_said}. Sharded along columns, kaiming's bound is "
        f"{k['bound_column_shard']:.4f} instead of {k['bound_full']:.4f}, {ratio:.3f}× ({is_root}): "
        f"values up to {k['max_abs_column_shard']:.4f} where the full tensor's reach "
        f"{k['max_abs_full']:.4f}. `DeterministicInit`'s slices, concatenated, {det} its full "
        "tensor bitwise."
    )


def agreement_time_text(rows: list[dict[str, Any]]) -> str:
    """Per size, which approach was ready first and by how much, and how much of the broadcast's
    time rank 0 spent inside its collectives (the rest is the init work it does alone)."""
    lines = []
    for row in rows:
        sync, det = row["sync_module_states"], row["deterministic"]
        said = compare_times("`DeterministicInit`", det["time_s"], "`sync_module_states`",
                             sync["time_s"])  # fmt: skip
        total, comm = sync["time_s_per_rank"][0], sync["comm_time_s_per_rank"][0]
        inside = f"{comm / total:.0%}" if total > 0 else "—"
        lines.append(
            f"- {fb(row['parameter_bytes'])}: {said}; of `sync_module_states`' {_s(total)} on "
            f"rank 0, {_s(comm)} ({inside}) were inside its broadcasts."
        )
    lines.append(
        "\nRank 0's time outside its broadcasts is its own work: initialising each unit, "
        "copying its slices into the shards."
    )
    return "\n".join(lines)


def agreement_text(result: LabResult) -> str:
    """What the agreement table says, from its numbers: bitwise verdicts, the control, bytes
    against theory, time per size, and the broadcast's bytes for the measured 70B model."""
    rows, n = result["agreement"]["rows"], result["world_size"]
    sizes = _names([fb(r["parameter_bytes"]) for r in rows])
    wrong = [f"{a} at {fb(r['parameter_bytes'])}" for r in rows for a in APPROACHES
             if not r[a]["bitwise_equal_to_reference"]]  # fmt: skip
    if wrong:
        bitwise = f"- **not** bitwise equal to the reference: {_names(wrong)}."
    else:
        bitwise = f"- both approaches gave **bitwise** the reference at every size ({sizes})."
    c = result["agreement"]["control"]
    differ, total = len(c["mismatched_parameters"]), c.get("parameter_names")
    of = f"{differ} of {total}" if total else str(differ)
    if c["bitwise_equal_to_reference"]:
        why = " (one rank: no other stream to disagree with)" if n == 1 else ""
        control = f"- the control ({CONTROL}: no broadcast) **also** matched the reference{why}."
    else:
        example = ", ".join(f"`{p}`" for p in c["mismatched_parameters"][:2])
        control = (
            f"- the control ({CONTROL}: same code, no broadcast) did not: {of} parameters "
            f"differ (e.g. {example}), so the check catches ranks that disagree."
        )
    syncs = [(fb(r["parameter_bytes"]), r["sync_module_states"]) for r in rows]
    off = [size for size, x in syncs if x["bytes_moved"] != x["theory_bytes_moved"]]
    moved_det = [fb(r["parameter_bytes"]) for r in rows if r["deterministic"]["bytes_moved"]]
    if off:
        sync = f"- `sync_module_states` moved **other** bytes than the theory at {_names(off)}"
    else:
        sync = "- `sync_module_states` moved exactly the theory's bytes at every size (parameters "
        sync += "+ buffers once per rank)"
    sync += "; `DeterministicInit` moved "
    sync += f"bytes at {_names(moved_det)}." if moved_det else "nothing."
    lines = [bitwise, control, sync, "", "Time to a sharded, initialised model (slowest rank):", ""]
    lines.append(agreement_time_text(rows))
    s = result["seventy_b"]
    if s and n > 1:
        m = s["summary"]
        wire = theory.sync_module_states_bytes(m["parameter_bytes"], m["buffer_bytes"], n)
        lines += [
            "",
            "These ranks share one machine, so no broadcast here crossed a network link. "
            f"Across machines it is the model over the network: for the Llama-3-70B measured in "
            f"section 1, {fb(wire)} to every rank, while rank 0 initialises the whole model "
            "alone; the slices cost each rank its 1/N of the init work and no communication.",
        ]
    return "\n".join(lines)


# -- 5. init code on a parent module --------------------------------------------------------------


def parent_init_text(result: LabResult) -> str:
    """The course-note recipe against `shard`'s order, measured on TinyGPT (init on its root):
    per way, how many parameters differ from one process, on how many ranks; and the verdict."""
    p = result["parent_init"]
    rows = []
    for how, r in p.items():
        differ = r["mismatched"]
        rows.append([how, PARENT_INIT[how], not differ, f"{len(differ)} of {r['parameter_names']}"]
                    + [f"`{differ[0]}`" if differ else "—"])  # fmt: skip
    head = ["way", "what it runs", "bitwise = one process (every rank)", "parameters that differ"]
    text = table([*head, "e.g."], rows)
    recipe = p[RECIPE]
    if recipe["mismatched"]:
        differ_on = recipe["ranks_that_differ"]
        where = (
            "every rank"
            if len(differ_on) == len(result["ties"])
            else (f"rank {_names([str(r) for r in differ_on])}")
        )
        verdict = (
            f"The recipe's claim fails here: on {where}, {len(recipe['mismatched'])} of "
            f"{recipe['parameter_names']} parameters came out other than an ordinary build's, "
            "without an error — TinyGPT's root owns no parameter itself, so the recipe never "
            "runs its `init_weights()`."
        )
    else:
        verdict = "The recipe gave the ordinary build's values here: it did not fail on this model."
    right = [h for h, r in p.items() if h != RECIPE and not r["mismatched"]]
    if right:
        verdict += f" {_names([f'`{h}`' for h in right])} matched one process bitwise."
    return f"{text}\n\n{verdict}"


# -- the command line's text ---------------------------------------------------------------------


def summary(result: LabResult) -> str:
    """Markdown: every table and every sentence above, in the notebook's order."""
    lines = [f"meta-device init on {result['world_size']} ranks ({result['backend']})", ""]
    if result["seventy_b"]:
        lines += ["### Llama-3-70B on meta (fresh process)", "", seventy_b_text(result), ""]
        lines += [model_state_table(result), ""]
    lines += [
        "### Host memory",
        "",
        memory_table(result["materialise"]),
        "",
        memory_text(result["materialise"]),
        "",
        peak_text(result),
        "",
        "### Buffers and ties",
        "",
        buffers_table(result),
        "",
        ties_table(result),
        "",
        to_empty_text(result),
        "",
        "### Making the ranks agree",
        "",
        kaiming_text(result["kaiming_on_a_shard"]),
        "",
        agreement_table(result["agreement"]["rows"]),
        "",
        agreement_text(result),
    ]
    if result["parent_init"]:
        lines += ["", "### Init on a parent module", "", parent_init_text(result)]
    return "\n".join(lines)


def meta_summary_table(summary: dict[str, Any]) -> str:
    """`meta_init.meta_summary` of a model as a two-column table: what the meta model has."""
    dtypes = ", ".join(
        f"{d}: {v['parameters']:,} ({fb(v['bytes'])})" for d, v in summary["by_dtype"].items()
    )
    rows = [
        ["parameters (a tied one once)", f"{summary['parameters']:,}"],
        ["parameter bytes, by dtype", f"{fb(summary['parameter_bytes'])} — {dtypes}"],
        ["parameter tensors", summary["parameter_tensors"]],
        ["names that alias a counted parameter (ties)", summary["shared_names"]],
        ["buffer elements (bytes)", f"{summary['buffers']:,} ({fb(summary['buffer_bytes'])})"],
        ["modules", summary["modules"]],
        ["devices", ", ".join(summary["devices"])],
    ]
    return table(["", "on meta"], rows)


def memory_table(memory: dict[str, Any]) -> str:
    """Markdown: per mode, rank 0's resident-memory growth, peak tensor bytes, theory, time."""
    head = ["mode", "resident memory: peak growth", "after trim", "tensor bytes: peak (theory)"]
    rows = [
        [r["how"], fb(r["rss_growth_bytes"][0]), fb(r["rss_after_trim_bytes"][0])]
        + [f"{fb(r['peak_bytes'][0])} ({fb(memory['theory_peak_bytes'][mode])})"]
        + [fb(r["after_bytes"][0]), f"{r['time_s'][0]:.2f} s"]
        for mode, r in memory["modes"].items()
    ]
    return (
        f"{memory['model_mb']} MiB Llama ({fb(memory['full_model_bytes'])} of parameters, "
        f"{memory['units']} units, largest {fb(memory['largest_unit_bytes'])}), rank 0:\n\n"
        + table([*head, "after shard", "time"], rows)
    )


def agreement_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per size and approach, time, bytes moved (theory), bitwise and buffer checks."""
    head = ["parameters", "approach", "time (slowest rank)", "rank 0 in collectives"]
    head += ["bytes moved per rank (theory)", "bitwise = reference", "buffers = ordinary"]
    return table(
        head,
        (
            [fb(row["parameter_bytes"]), a, f"{r['time_s']:.3f} s"]
            + [f"{r['comm_time_s_per_rank'][0]:.3f} s"]
            + [f"{fb(r['bytes_moved'])} ({fb(r['theory_bytes_moved'])})"]
            + [r["bitwise_equal_to_reference"], r["buffers_equal_to_ordinary"]]
            for row in rows
            for a, r in ((a, row[a]) for a in APPROACHES)
        ),
    )
