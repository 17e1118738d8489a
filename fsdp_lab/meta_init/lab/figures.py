"""Lab 04's pictures: resident memory over time per way of building (theory lines beside), and
start-up time and bytes moved against model size per way of making the ranks agree."""

from __future__ import annotations

from typing import Any

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.meta_init.lab.config import APPROACHES, MODES, MiB
from fsdp_lab.sizes import format_bytes as fb


def rss_figure(memory: dict[str, Any]) -> Any:
    """Resident memory over time per rank, the three modes, their tensor-byte theory beside."""
    from fsdp_lab.plots import plot_rss_over_time

    theory_peak = memory["theory_peak_bytes"]
    return plot_rss_over_time(
        {MODES[mode]: run["rss"] for mode, run in memory["modes"].items()},
        title=f"resident memory while building and sharding a {memory['model_mb']} MiB Llama",
        theory={
            "whole model + its shards": theory_peak["ordinary"],
            "shards + largest unit": theory_peak["meta_param_init_fn"],
            "shards (model / N)": theory_peak["meta_shard_init"],
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
    expected = [s["theory_bytes_moved"] / MiB for s in sync]
    ax_bytes.plot(x, expected, ":", color="black", lw=1.5, label="theory: parameters + buffers")
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
