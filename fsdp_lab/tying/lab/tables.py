"""Lab 03, as tables: every dict and list the lab returns, as Markdown rows for the notebook
and the summary (a learner reads a table; a dict's repr is for the debugger)."""

from __future__ import annotations

from typing import Any

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.markdown import table
from fsdp_lab.sizes import format_bytes

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
    """The lab's settings, one row each, with what each one sets (the config's docstring)."""
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
        "max \\|ours − single process\\|",
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
