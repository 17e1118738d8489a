"""Lab 04's plain tables (no verdict in them): what a meta model has, the host-memory figures
per way of building, the agreement figures per size and approach. The sentences that read
them are `report`'s."""

from __future__ import annotations

from typing import Any

from fsdp_lab.markdown import table
from fsdp_lab.meta_init.lab.config import APPROACHES
from fsdp_lab.sizes import format_bytes as fb


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
