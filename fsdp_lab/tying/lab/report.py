"""Lab 03, told: the sentences that set the claims about tying beside what this run measured
(the audit's verdict on "split ties break silently", the spike's plateau, peaks and cost, which
units were freed after forward, the verification and to_empty verdicts), docs/labs.md's spike
table, every table of the notebook, and the summary. Every number and every comparison is built
from the result; the pictures are in `figures.py`.

(Over 450 lines on purpose: the lab's one home for words and tables, in the order notebook 03
says them; it was two modules split by output type.)
"""

from __future__ import annotations

from typing import Any

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.markdown import max_diff, table
from fsdp_lab.sizes import format_bytes
from fsdp_lab.tying.lab.analysis import PHASES
from fsdp_lab.tying.lab.config import SPIKE_SYSTEMS, SYSTEM_NAMES, WRAPPINGS

ROUNDING = 1e-5  # |ours - single process| below this is float rounding (test_shard_lab's bound)
HELD = 0.9  # "held the tied matrix": at least this fraction of its bytes more than the other
_STAGES = {
    "wrap": "when wrapping",
    "forward": "in the first forward",
    "backward": "in the first backward",
    "step": "in the optimizer step",
}


# -- sentences built from the result: the claims, measured -------------------------------------


def _names(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _mentions_tie(error: str, tie_names: list[str]) -> bool:
    """Whether an error points at the tie: a tied parameter's name, or the words for it."""
    words = ("tied", "shared", "tie ")
    return any(n in error for n in tie_names) or any(w in error.lower() for w in words)


def audit_paragraph(rows: list[dict], tie_names: list[str], torch_version: str) -> str:
    """The claim "tied weights split across wrap units break silently", read against the
    audit's rows: which systems accepted the split tie and broke it without a word, which kept
    it, which refused (where, and whether the error names the tie)."""
    silent, kept, named, unrelated, unchecked = [], [], [], [], []
    for row in rows:
        name = f"**{row['system']}**"
        if row["accepted"] and row["still_tied"] is False:
            values = "already differ" if row["equal_values"] is False else "are still equal"
            silent.append(f"{name} (two tensors after one step; their values {values})")
        elif row["accepted"] and row["still_tied"]:
            kept.append(name)
        elif row["accepted"]:
            unchecked.append(f"{name} ({row['error']})")
        else:
            where = f"{name} {_STAGES[row['stage']]}: `{row['error'].rstrip('.')}`"
            (named if _mentions_tie(row["error"], tie_names) else unrelated).append(where)
    lines = [
        f"The claim: *tied weights split across wrap units break silently.* Measured on torch "
        f"{torch_version}, one step each:",
        "",
    ]
    if silent:
        lines.append(
            f"- **accepted the plan and broke the tie without an error**: {_names(silent)}."
        )
    if kept:
        lines.append(f"- **accepted it and kept one tensor for both modules**: {_names(kept)}.")
    if unchecked:
        lines.append(f"- **accepted it; the tie could not be inspected**: {_names(unchecked)}.")
    for where in named:
        lines.append(f"- **refused, naming the tie**: {where}")
    for where in unrelated:
        lines.append(
            f"- **failed with an error that does not name the tie**: {where} — a crash, not a "
            "silent break, but nothing in it points at the split tie."
        )
    systems = [row["system"] for row in rows]
    breakers = [row["system"] for row in rows if row["accepted"] and row["still_tied"] is False]
    if not breakers:
        conclusion = (
            "So on this torch the claim holds for none of them: no system broke the tie silently."
        )
    elif len(breakers) == len(systems):
        conclusion = "So on this torch the claim holds for every system audited."
    else:
        conclusion = (
            f"So on this torch the claim holds only for {_names(breakers)}; "
            f"not for {_names([s for s in systems if s not in breakers])}."
        )
    return "\n".join([*lines, "", conclusion])


def verification_sentence(result: LabResult) -> str:
    """Section 3's verdict: did the tie hold on every rank, and how close is one process."""
    v = result["verification"]
    problems = {w: sum(map(len, r["right_after_shard"] + r["after_steps"])) for w, r in v.items()}
    steps = next(iter(v.values()))["steps"]
    diff = max(r["max_abs_diff_vs_single_process"] for r in v.values())
    if not any(problems.values()) and all(r["head_equals_embedding"] for r in v.values()):
        held = (
            f"The tie held with {'both plans' if len(v) == 2 else 'every plan'}: no problem on "
            f"any rank right after `shard` or after {steps} steps, and after training the "
            "head's matrix equals the embedding's."
        )
    else:
        broken = [f"{w} ({n} problems)" for w, n in problems.items() if n]
        unequal = [w for w, r in v.items() if not r["head_equals_embedding"]]
        held = (
            f"The tie did not hold: {_names(broken + [f'{w}: head ≠ embedding' for w in unequal])}."
        )
    close = (
        "float rounding (the ranks sum their gradients in another order)"
        if diff < ROUNDING
        else f"more than float rounding (above {ROUNDING:g})"
    )
    return f"{held} Against one process the parameters differ by at most {diff:.2g}: {close}."


def to_empty_sentence(to_empty: dict[str, Any]) -> str:
    """Section 5's verdict on this torch: did `to_empty` untie, and what `shard` said (rank 0)."""
    names = " and ".join(f"`{n}`" for n in to_empty["ties"][0]) if to_empty["ties"] else "its ties"
    rank0 = to_empty["per_rank"][0]
    if to_empty["tied_after_to_empty"]:
        what = f"On torch {to_empty['torch']}, `to_empty` kept the tie: {names} are one Parameter."
    else:
        what = (
            f"On torch {to_empty['torch']}, `to_empty` untied the model: {names} are now two "
            "Parameters."
        )
    said = "refused it" if rank0["shard_refused"] else "accepted it"
    return f"{what} `shard`, given the ties recorded on meta, {said} (rank 0)."


def matrix_sentence(spike: dict[str, Any]) -> str:
    """The tied matrix's size beside the blocks', from the spike's model."""
    m, model = spike["tied_matrix_bytes"], spike["model"]
    blocks = spike["block_bytes"]
    than = "more than" if m > blocks else "less than" if m < blocks else "as much as"
    return (
        f"Here V = {model['vocab_size']}, d = {model['dim']}: the tied matrix is "
        f"{format_bytes(m)}, {than} the {spike['layers']} blocks together ({format_bytes(blocks)})."
    )


def freed_sentence(spike: dict[str, Any], system: str) -> str:
    """Which units this run freed after forward (rank 0, as the run left them)."""
    name = SYSTEM_NAMES[system]
    freed_by_wrapping = [spike[system][w]["freed_after_forward"] for w in WRAPPINGS]
    if any(f is None for f in freed_by_wrapping):
        return f"{name}: which units it freed after forward could not be read on this torch."
    said = []
    for freed in freed_by_wrapping:
        kept = [u for u, f in freed.items() if not f]
        if kept == ["root"]:
            said.append("every unit but the root unit, which stayed gathered for the backward")
        elif not kept:
            said.append("every unit, the root unit included")
        else:
            freed_units = [u for u, f in freed.items() if f]
            said.append(f"{_names(freed_units) if freed_units else 'no unit'}, kept {_names(kept)}")
    if len(set(said)) == 1:
        return f"{name}, in this run, with both plans: after forward it freed {said[0]}."
    parts = [
        f"with the {w.replace('_', ' ')} plan it freed {what}"
        for w, what in zip(WRAPPINGS, said, strict=True)
    ]
    return f"{name}, in this run: after forward, " + "; ".join(parts) + "."


def _when(phase: dict[str, Any]) -> str:
    if phase["step"] is None:
        return "after the last step"
    return f"step {phase['step']}'s {phase['phase']}"


def spike_paragraph(spike: dict[str, Any], system: str, rank: int = 0) -> str:
    """Section 6's comparisons for one system, each built from the measured phases: whether
    the root unit held the tied matrix from the embedding to the end of forward (a plateau,
    or the claimed spikes), where each peak fell, whether the peaks are equal, and what the
    root unit cost."""
    m = spike["tied_matrix_bytes"]
    root, joint = spike[system]["root_unit"], spike[system]["joint_unit"]
    at = {k: (root[k][rank], joint[k][rank]) for k in ("blocks_min_bytes", "end_of_forward_bytes")}
    held_blocks = at["blocks_min_bytes"][0] - at["blocks_min_bytes"][1]
    held_end = at["end_of_forward_bytes"][0] - at["end_of_forward_bytes"][1]
    name, matrix = SYSTEM_NAMES[system], format_bytes(m)
    lines = [f"**{name}** (rank {rank}; the tied matrix is {matrix}):", ""]
    if held_blocks >= HELD * m and held_end >= HELD * m:
        lines.append(
            f"- The root unit held the tied matrix from the embedding to the end of forward: "
            f"{format_bytes(held_blocks)} more than the joint unit at the lowest point while "
            f"the blocks ran, {format_bytes(held_end)} more at the end of forward. A plateau, "
            "not a spike at the embedding's gather and another at the head's."
        )
    elif held_end >= HELD * m:
        lines.append(
            f"- While the blocks ran the joint unit held as much as the root unit (root minus "
            f"joint: {format_bytes(held_blocks)} at the lowest point): this system's joint "
            f"unit, too, keeps the matrix from the embedding to the head. The root unit held "
            f"{format_bytes(held_end)} more only at the end of forward."
        )
    else:
        lines.append(
            f"- Root unit minus joint unit: {format_bytes(held_blocks)} at the lowest point "
            f"while the blocks ran, {format_bytes(held_end)} at the end of forward — less than "
            f"the tied matrix both times."
        )
    where_root, where_joint = (_when(r["peak_phase"][rank]) for r in (root, joint))
    if where_root == where_joint:
        lines.append(f"- Both peaks fell in {where_root}.")
    else:
        lines.append(
            f"- The root unit's peak fell in {where_root}, the joint unit's in {where_joint}."
        )
    peak_root, peak_joint = root["peak_bytes"][rank], joint["peak_bytes"][rank]
    if peak_root == peak_joint:
        lines.append(
            f"- The peaks are equal ({format_bytes(peak_root)}): at these sizes the joint "
            "unit does not lower the peak; what the root unit costs is the matrix held under "
            "it, memory that activations could have used."
        )
    else:
        higher = "root" if peak_root > peak_joint else "joint"
        diff = abs(peak_root - peak_joint)
        lines.append(
            f"- The peaks differ: the {higher} unit's is higher by {format_bytes(diff)} "
            f"({diff / m:.0%} of the tied matrix; root {format_bytes(peak_root)}, joint "
            f"{format_bytes(peak_joint)})."
        )
    return "\n".join(lines)


_DOC_ROWS = {  # (system, wrapping) -> docs/labs.md's row name
    ("fsdp_lab", "root_unit"): "ours, tied pair in the root unit",
    ("fsdp_lab", "joint_unit"): 'ours, joint unit `("tok_emb", "head")`',
    ("fsdp2", "root_unit"): "FSDP2, root unit",
    ("fsdp2", "joint_unit"): "FSDP2, `fully_shard([tok_emb, head])`",
}


def spike_caption(result: LabResult) -> str:
    """The line above `spike_table`: the spike's model, tokens and step, from the result."""
    spike = result["spike"]
    model = spike["model"]
    agree = all(
        len(set(spike[s][w][k])) == 1
        for s in SPIKE_SYSTEMS
        if s in spike
        for w in WRAPPINGS
        for k in PHASES
    )
    n = result["world_size"]
    alike = "both ranks alike" if n == 2 else f"all {n} ranks alike"
    ranks = alike if agree else "rank 0; the ranks differ"
    return (
        f"the root-unit spike, TinyGPT with V={model['vocab_size']}, d={model['dim']} (tied "
        f"matrix {format_bytes(spike['tied_matrix_bytes'])}), {model['n_layers']} blocks, batch "
        f"{spike['batch_per_rank']} × {spike['seq_len']} tokens per rank, last of "
        f"{spike['steps']} SGD steps, per rank ({ranks}):"
    )


def spike_table(result: LabResult) -> str:
    """docs/labs.md's spike table: bytes per phase (rank 0) for each system and wrapping that
    ran. Deterministic: tensor bytes from `MemoryTracker`, no times."""
    spike = result["spike"]
    rows = [
        (name, *(format_bytes(spike[s][w][k][0]) for k in PHASES))
        for (s, w), name in _DOC_ROWS.items()
        if s in spike
    ]
    return table(("", *PHASES.values()), rows)


def audit_claim(result: LabResult) -> str:
    """`audit_paragraph` for this result: its audit rows, the audited model's tie, its torch."""
    tie_names = result["ties"][result["model"]][0]["names"]
    return audit_paragraph(result["audit"], tie_names, result["to_empty"]["torch"])


def freed_list(result: LabResult) -> str:
    """`freed_sentence` of each system that ran, as a Markdown list."""
    spike = result["spike"]
    return "\n".join(f"- {freed_sentence(spike, s)}" for s in SPIKE_SYSTEMS if s in spike)


def spike_comparisons(result: LabResult) -> str:
    """Section 6's comparisons: `spike_paragraph` of each system that ran."""
    spike = result["spike"]
    return "\n\n".join(spike_paragraph(spike, s) for s in SPIKE_SYSTEMS if s in spike)


def summary(result: LabResult) -> str:
    """Markdown: what each section ran on, ties, plans, verification, to_empty, the audit's
    table and what it says of the claim, the spike's verdicts and comparisons."""
    lines = [f"weight tying on {result['world_size']} ranks ({result['backend']})", ""]
    lines += [sections_table(result), ""]
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
            + max_diff("ours", "single process", v["max_abs_diff_vs_single_process"])
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
        audit_claim(result),
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
    spike_text = [matrix_sentence(spike), spike_comparisons(result), freed_list(result)]
    return "\n".join([*lines, "", "\n\n".join(spike_text)])


SECTIONS = {  # the result's sections -> how the notebook and the summary name them
    "plans": "2 · plans and diagrams",
    "verification": "3 · shard, train, verify",
    "audit": "4 · live audit",
    "to_empty": "5 · to_empty",
    "spike": "6 · root-unit spike",
}


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


def config_table(config: Any) -> str:
    """The lab's settings, one row each, with what each one sets (its knob's help)."""
    from dataclasses import fields

    from fsdp_lab.config_checks import field_help

    helps = field_help(type(config))
    rows = [(f.name, getattr(config, f.name), helps.get(f.name, "")) for f in fields(config)]
    return table(("setting", "value", "what it sets"), rows)


def sections_table(result: LabResult) -> str:
    """Which model each section ran on, read off the model it built, and the tokens it trained."""
    rows = []
    for key, name in SECTIONS.items():
        s = result["sections"][key]
        tokens = f"{s['batch_per_rank']} × {s['seq_len']}" if s["batch_per_rank"] else None
        shape = f"{s['vocab']} × {s['dim']}"
        rows.append(
            (name, s["model"], shape, s["layers"], f"{s['parameters']:,}", tokens, s["steps"])
        )
    header = ("section", "model", "tied V × d", "blocks", "parameters", "tokens per rank", "steps")
    return table(header, rows)


def ties_table(ties: list[dict]) -> str:
    """`plans.detect_ties`' list as a table: one row per tie."""
    rows = [
        (
            " = ".join(t["names"]),
            ", ".join(f"{m} ({k})" for m, k in zip(t["modules"], t["module_types"], strict=True)),
            t["kind"],
            " × ".join(map(str, t["shape"])),
            format_bytes(t["bytes"]),
        )
        for t in ties
    ]
    return table(("names", "owning modules", "kind", "shape", "bytes"), rows)


def plans_table(plans: dict[str, dict]) -> str:
    """The lab's plans as `build_plan` judged them."""
    rows = [
        (name, plan["units"], "valid" if plan["valid"] else "refused")
        for name, plan in plans.items()
    ]
    return table(("plan", "units", "build_plan"), rows)


def verification_table(result: LabResult) -> str:
    """Per valid plan: its units, tie problems per rank after shard and after training, and the
    comparison with one process."""
    rows = []
    for name, v in result["verification"].items():
        rows.append(
            (
                name,
                ", ".join(v["units"]),
                sum(map(len, v["right_after_shard"])),
                sum(map(len, v["after_steps"])),
                v["head_equals_embedding"],
                f"{v['max_abs_diff_vs_single_process']:.2g}",
            )
        )
    steps = next(iter(result["verification"].values()))["steps"]
    header = (
        "plan",
        "units",
        "tie problems after shard (all ranks)",
        f"after {steps} steps",
        "head = embedding after training",
        "max |ours − single process|",
    )
    return table(header, rows)


_TO_EMPTY_ROWS = {
    "to_empty": (
        ("tied on meta", "tied_on_meta"),
        ("tied after to_empty", "tied_after_to_empty"),
        ("shard refused the untied model", "shard_refused"),
    ),
    "retie": (
        ("tied after retie", "tied_after_retie"),
        ("shard accepted it", "shard_accepted_after_retie"),
        ("tie problems after a step", "problems_after_retie_and_a_step"),
    ),
}


def to_empty_table(to_empty: dict[str, Any], stage: str) -> str:
    """One question per row, one column per rank: ``stage="to_empty"`` (the tie lost, shard's
    answer) or ``"retie"`` (the repair, and a step)."""
    if stage not in _TO_EMPTY_ROWS:
        raise ValueError(f"stage={stage!r}: expected one of {sorted(_TO_EMPTY_ROWS)}")
    per_rank = to_empty["per_rank"]
    rows = []
    for question, key in _TO_EMPTY_ROWS[stage]:
        values = [to_empty[key] if key == "tied_on_meta" else r[key] for r in per_rank]
        rows.append((question, *[len(v) if isinstance(v, list) else v for v in values]))
    return table(
        ("on torch " + to_empty["torch"], *(f"rank {r}" for r in range(len(per_rank)))), rows
    )
