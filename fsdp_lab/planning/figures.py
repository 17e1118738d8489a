"""A plan drawn: per-GPU memory by category for every strategy at one size, against the GPU.

One horizontal bar per strategy, stacked by category in the colours every memory figure of the
lab uses (`plots.CATEGORY_COLORS`; gathered units are the tracker's "comm_buffers"), the GPU's
usable memory as a line; where a plan was verified, the measured peak as a black mark on its
bar — theory beside the measurement, never instead of it.
"""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure

from fsdp_lab.plots import CATEGORY_COLORS
from fsdp_lab.sizes import byte_unit

CATEGORIES = {  # the plan's names -> the colour of the tracker's category
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer_state",
    "gathered": "comm_buffers",
    "activations": "activations",
}


def draw_strategies(plans: list[dict[str, Any]]) -> Figure:
    """`plans`: one per strategy, the same model and cluster (`planning.planner.plan`)."""
    fig = Figure(figsize=(8.5, 0.55 * len(plans) + 1.6))
    ax = fig.add_subplot()
    usable = plans[0]["usable_bytes"]
    top = max([usable, *(p["per_rank_bytes"]["total"] for p in plans)])
    unit, scale = byte_unit(top)
    for row, plan in enumerate(plans):
        left = 0.0
        for name, colour in CATEGORIES.items():
            value = (plan["per_rank_bytes"][name] or 0.0) / scale
            ax.barh(
                row,
                value,
                left=left,
                color=CATEGORY_COLORS[colour],
                label=name if row == 0 else None,
            )
            left += value
        verified = plan.get("verified")
        if verified:
            ax.plot(
                verified["per_rank_bytes"]["total"] / scale,
                row,
                marker="|",
                color="black",
                markersize=22,
                markeredgewidth=2.5,
                label="measured (fake rank)" if row == 0 else None,
            )
    ax.axvline(usable / scale, color="black", linestyle="--", linewidth=1)
    ax.text(usable / scale, len(plans) - 0.45, " usable", va="bottom", fontsize="small")
    ax.set_yticks(range(len(plans)), [p["strategy"] for p in plans])
    ax.invert_yaxis()
    first = plans[0]
    ax.set_xlabel(f"peak per GPU ({unit})")
    ax.set_title(
        f"{first['model']} on {first['gpus']} {first['gpu']}, seq {first['seq']} x "
        f"{first['micro_batch']}, checkpoint {first['checkpoint']}",
        fontsize="medium",
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    fig.tight_layout()
    return fig
