"""Lab 04, shown: resident memory over time per way of building, the agreement plot (time and
bytes against model size), and the tables the notebook and the command line print."""

from __future__ import annotations

from typing import Any

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.labs.meta_init.config import APPROACHES, CONTROL, MODES, MiB
from fsdp_lab.markdown import table
from fsdp_lab.sizes import format_bytes as fb


def rss_figure(memory: dict[str, Any]) -> Any:
    """Resident memory over time per rank, the three modes, their tensor-byte theory beside."""
    from fsdp_lab.plots import plot_rss_over_time

    theory = memory["theory_peak_bytes"]
    return plot_rss_over_time(
        {MODES[mode]: run["rss"] for mode, run in memory["modes"].items()},
        title=f"resident memory while building and sharding a {memory['model_mb']} MiB Llama",
        theory={
            "whole model + its shards": theory["ordinary"],
            "shards + largest unit": theory["meta_param_init_fn"],
            "shards (model / N)": theory["meta_shard_init"],
        },
    )


def agreement_figure(rows: list[dict[str, Any]]) -> Any:
    """Start-up time and bytes moved per rank against model size, one line per approach."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), layout="constrained")
    ax_time, ax_bytes = fig.subplots(1, 2)
    x = [r["parameter_bytes"] / MiB for r in rows]
    for approach, color in zip(APPROACHES, ("#C44E52", "#4C72B0"), strict=True):
        ax_time.plot(x, [r[approach]["time_s"] for r in rows], "o-", color=color, label=approach)
        moved = [r[approach]["bytes_moved"] / MiB for r in rows]
        ax_bytes.plot(x, moved, "o-", color=color, label=f"{approach} (measured)")
    sync = [r["sync_module_states"] for r in rows]
    theory = [s["theory_bytes_moved"] / MiB for s in sync]
    ax_bytes.plot(x, theory, ":", color="black", lw=1.5, label="theory: parameters + buffers")
    for s, xi in zip(sync, x, strict=True):
        ax_bytes.annotate(fb(s["bytes_moved"]), (xi, s["bytes_moved"] / MiB), fontsize=7,
                          textcoords="offset points", xytext=(0, 6), ha="center")  # fmt: skip
    ax_time.set_ylabel("shard() time, slowest rank (s)")
    ax_bytes.set_ylabel("bytes moved per rank (MiB)")
    for ax in (ax_time, ax_bytes):
        ax.set_xlabel("model parameters (MiB, fp32)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax_time.set_title("time to a sharded, initialised model", fontsize=10)
    ax_bytes.set_title("communication to make the ranks agree", fontsize=10)
    return fig


def figures(result: LabResult) -> dict[str, Any]:
    """The host-memory picture and the agreement plot, by file stem."""
    return {
        "rss_over_time": rss_figure(result["materialise"]),
        "agreement": agreement_figure(result["agreement"]["rows"]),
    }


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


def summary(result: LabResult) -> str:
    """Markdown: the 70B build, the host-memory table, the ties, the agreement table and notes."""
    lines = [f"meta-device init on {result['world_size']} ranks ({result['backend']})", ""]
    if result["seventy_b"]:
        s = result["seventy_b"]
        lines.append(
            f"- Llama-3-70B on meta (fresh process): {s['summary']['parameters'] / 1e9:.2f}e9 "
            f"parameters ({fb(s['summary']['parameter_bytes'])} fp32) built in "
            f"{s['build_time_s']:.2f} s, resident memory +{fb(s['rss_growth_bytes'])}"
        )
    t, c, k = result["ties"][0], result["agreement"]["control"], result["kaiming_on_a_shard"]
    lines += [
        "",
        "### Host memory",
        "",
        memory_table(result["materialise"]),
        "",
        f"- tied Llama: problems after shard {t['param_init_fn']['problems_after_shard']} "
        f"(param_init_fn), {t['shard_init']['problems_after_shard']} (shard_init); "
        f"after to_empty without retie, shard refused: {t['to_empty']['shard_refused']}",
        "",
        "### Making the ranks agree",
        "",
        agreement_table(result["agreement"]["rows"]),
        "",
        f"- control ({CONTROL}: ordinary init, a different seed per rank, no broadcast): "
        f"bitwise equal {c['bitwise_equal_to_reference']}, "
        f"{len(c['mismatched_parameters'])} parameters differ"
        + (" (one rank: no other stream to disagree with)" if result["world_size"] == 1 else ""),
        f"- kaiming_uniform_ on row shards of {k['shape']} over {k['world_size']} ranks: "
        f"equal to their own rows {k['row_shards_equal_own_rows']}, to the first rows "
        f"{k['row_shards_equal_first_rows']}; a column shard's bound "
        f"{k['bound_column_shard']:.4f} vs {k['bound_full']:.4f}; DeterministicInit's "
        f"slices equal its full tensor: {k['deterministic_slices_equal_full']}",
    ]
    return "\n".join(lines)
