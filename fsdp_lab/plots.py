"""Pictures of measurements: memory over time, compute/communication timelines, theory checks.

(Over 400 lines on purpose: one function per kind of figure, sharing the colours, byte axes and
marker rules defined at the top; split, a learner would meet two colour schemes.)

What it teaches: a number is easier to believe when you can see it. Every lab measures something
(bytes held per category, spans of compute and communication, tensors held by each rank) and
these functions draw the measurement next to the theory, in the way PyTorch's memory snapshot
viewer and profiler traces do for real FSDP runs, reduced to what a lesson needs.

The functions take plain dicts and lists (the exported form of `fsdp_lab.trace` records), so
they can be used on saved JSON and do not import the rest of the package. Each returns a
`matplotlib.figure.Figure` built without pyplot: no global figure state, so a notebook shows a
figure once (as the cell's value) and re-running a cell does not leak figures.
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator

from fsdp_lab.sizes import byte_unit, format_bytes

# One colour per memory category, the same in every figure so a reader learns them once.
CATEGORY_COLORS: dict[str, str] = {
    "parameters": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer_state": "#55A868",
    "activations": "#C44E52",
    "comm_buffers": "#8172B3",
    "other": "#A0A0A0",
}
KIND_COLORS: dict[str, str] = {"compute": "#4C72B0", "comm": "#DD8452"}
_THEORY_COLORS = ["#2F2F2F", "#8C564B", "#17BECF", "#BCBD22", "#E377C2"]
_MAX_MARKER_LABELS = 30
_MARKER_LABEL_STYLE = {
    "rotation": 90, "va": "top", "ha": "right", "fontsize": 7, "color": "#333333",
    "bbox": {"facecolor": "white", "alpha": 0.6, "edgecolor": "none", "pad": 0.5},
}  # fmt: skip


def _format_value(v: float) -> str:
    """Integers without a decimal point (rank ids, element values), others to 3 digits."""
    return str(int(v)) if float(v).is_integer() else f"{v:.3g}"


def _rank_title(record: dict[str, Any], index: int) -> str:
    rank = record.get("rank")
    return f"rank {rank}" if rank is not None else f"process {index}"


def plot_memory_trace(
    traces: dict | list[dict],
    *,
    title: str | None = None,
    theory: dict[str, float] | None = None,
) -> Figure:
    """Stacked memory by category over time, one panel per rank, with markers and the peak.

    Args:
        traces: one exported memory trace (dict) or a list of them, one per rank.
        title: figure title.
        theory: label -> bytes, drawn as dotted horizontal lines beside the measurement.
    """
    traces = [traces] if isinstance(traces, dict) else list(traces)
    if not traces:
        raise ValueError("plot_memory_trace needs at least one trace")
    theory = theory or {}
    # One unit for all panels (the y axis is shared), chosen from the largest thing drawn.
    largest = max(
        [max(tr.get("total") or [0]) for tr in traces]
        + [tr.get("peak_bytes", 0) for tr in traces]
        + list(theory.values())
    )
    unit, scale = byte_unit(largest)

    fig = Figure(figsize=(11, 1.0 + 2.6 * len(traces)), layout="constrained")
    axes = fig.subplots(len(traces), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    for i, (ax, tr) in enumerate(zip(axes, traces, strict=True)):
        t = np.asarray(tr["t"], dtype=float)
        cats = list(tr["categories"])
        ys = [np.asarray(tr["bytes"][c], dtype=float) / scale for c in cats]
        # Leave all-zero categories out of the legend (they add nothing to the stack either).
        labels = [c if np.any(y) else f"_{c}" for c, y in zip(cats, ys, strict=True)]
        colors = [CATEGORY_COLORS.get(c, "#CCCCCC") for c in cats]
        if len(t):
            # step="post": a storage lives at its size until the next event, it does not ramp.
            ax.stackplot(t, *ys, labels=labels, colors=colors, step="post", linewidth=0)
            # The total as a thin outline: a storage made and freed inside one operator (two
            # samples at one instant) has no width in the stack, but it is a real peak.
            total = np.asarray(tr.get("total") or np.sum(ys, axis=0) * scale, dtype=float)
            ax.step(t, total / scale, where="post", color="black", lw=0.5, alpha=0.7)
        peak = tr.get("peak_bytes", max(tr.get("total") or [0]))
        ax.axhline(peak / scale, color="black", ls="--", lw=1.0, label=f"peak {format_bytes(peak)}")
        for j, (name, value) in enumerate(theory.items()):
            color = _THEORY_COLORS[j % len(_THEORY_COLORS)]
            label = f"theory: {name} {format_bytes(value)}"
            ax.axhline(value / scale, color=color, ls=":", lw=1.6, label=label)
        _draw_markers(ax, tr.get("markers", []))
        source = tr.get("source", "")
        ax.set_title(f"{_rank_title(tr, i)}  ({tr.get('device', '?')}, {source})", fontsize=10)
        ax.set_ylabel(f"memory ({unit})")
        # Headroom above the peak, where the marker labels hang without covering the stack.
        ax.set_ylim(0, 1.4 * largest / scale if largest else 1)
        # The legend goes outside the axes so it never hides the stack.
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    axes[-1].set_xlabel("time since start (s)")
    if title:
        fig.suptitle(title)
    return fig


def _draw_markers(ax: Any, markers: Sequence[dict[str, Any]]) -> None:
    """Thin vertical lines at marker times; labels thinned to at most ~30 so they stay readable."""
    step = max(1, math.ceil(len(markers) / _MAX_MARKER_LABELS))
    for k, m in enumerate(markers):
        labelled = k % step == 0
        # Unlabelled lines are fainter: with hundreds of markers they would hide the stack.
        ax.axvline(m["t"], color="#555555", lw=0.5, alpha=0.6 if labelled else 0.2)
        if labelled:
            # x in data coordinates, y in axes coordinates: labels hang from the top edge.
            label = f" {m['label']}"
            ax.text(m["t"], 0.98, label, transform=ax.get_xaxis_transform(), **_MARKER_LABEL_STYLE)


def plot_timeline(timelines: dict | list[dict], *, title: str | None = None) -> Figure:
    """Gantt chart of compute and communication spans, two lanes per rank so overlap shows.

    Args:
        timelines: one exported timeline ``{"rank", "spans"}`` or a list, one per rank.
        title: figure title.
    """
    timelines = [timelines] if isinstance(timelines, dict) else list(timelines)
    if not timelines:
        raise ValueError("plot_timeline needs at least one timeline")
    # Ranks have no common clock origin, so each is aligned to its own first span.
    origins = [min((s["start"] for s in tl["spans"]), default=0.0) for tl in timelines]
    duration = max(
        (s["end"] - t0 for tl, t0 in zip(timelines, origins, strict=True) for s in tl["spans"]),
        default=0.0,
    )
    unit, scale = ("s", 1.0) if duration >= 1 else ("ms", 1e3) if duration >= 1e-3 else ("µs", 1e6)

    fig = Figure(figsize=(11, 0.9 + 0.9 * len(timelines)), layout="constrained")
    ax = fig.subplots()
    lanes = ("compute", "comm")
    ticks, tick_labels = [], []
    for i, (tl, t0) in enumerate(zip(timelines, origins, strict=True)):
        name = _rank_title(tl, i)
        if i:
            ax.axhline(2 * i - 0.5, color="#999999", lw=0.8)  # separates one rank from the next
        for lane_index, kind in enumerate(lanes):
            y = 2 * i + lane_index  # rank i's compute lane sits right above its comm lane
            ticks.append(y)
            tick_labels.append(f"{name} {kind}")
            spans = [s for s in tl["spans"] if s["kind"] == kind]
            if not spans:
                continue
            ranges = [((s["start"] - t0) * scale, (s["end"] - s["start"]) * scale) for s in spans]
            ax.broken_barh(
                ranges, (y - 0.4, 0.8), facecolors=KIND_COLORS[kind], edgecolor="white", lw=0.5
            )
            if kind == "comm":
                _label_wide_spans(ax, spans, ranges, y, duration * scale)
    ax.set_yticks(ticks, tick_labels, fontsize=8)
    ax.set_ylim(len(ticks) - 0.5, -0.5)  # rank 0 on top, like a profiler trace
    ax.set_xlim(0, max(duration * scale, 1e-9) * 1.01)
    ax.set_xlabel(f"time since each rank's first span ({unit}; ranks aligned separately)")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=KIND_COLORS[k], label=k) for k in lanes]
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=2, fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


def _label_wide_spans(
    ax: Any, spans: list[dict], ranges: list[tuple[float, float]], y: float, full: float
) -> None:
    """Write the collective's name inside comm spans wide enough to hold it."""
    for span, (x, width) in zip(spans, ranges, strict=True):
        # At fontsize 7 on an 11-inch figure a character takes about 0.5% of the axis width.
        if full > 0 and width / full > 0.005 * len(span["name"]) + 0.005:
            ax.text(x + width / 2, y, span["name"], ha="center", va="center", fontsize=7)


def plot_measured_vs_theory(
    measured: dict[str, float],
    theory: dict[str, float],
    *,
    ylabel: str = "bytes",
    title: str | None = None,
) -> Figure:
    """Grouped bars, measured (solid) beside theory (hatched), with the ratio measured/theory.

    Args:
        measured: key -> measured value.
        theory: key -> predicted value; keys in only one dict get a single bar.
        ylabel: y axis label; ``"bytes"`` also formats ticks and labels as KiB/MiB/GiB.
        title: axes title.
    """
    keys = list(measured) + [k for k in theory if k not in measured]
    fmt = format_bytes if ylabel == "bytes" else _format_value
    fig = Figure(figsize=(max(5.0, 1.4 * len(keys) + 2), 4.2), layout="constrained")
    ax = fig.subplots()
    width = 0.38
    x = np.arange(len(keys))
    # Bars keep the raw values (heights are the inputs); only the tick labels are humanised.
    measured_style = {"color": "#4C72B0"}
    theory_style = {"facecolor": "white", "edgecolor": "#4C72B0", "hatch": "//"}
    for label, values, offset, style in (
        ("measured", measured, -width / 2, measured_style),
        ("theory", theory, width / 2, theory_style),
    ):
        idx = [i for i, k in enumerate(keys) if k in values]  # a missing key gets no bar
        heights = [values[keys[i]] for i in idx]
        bars = ax.bar(x[idx] + offset, heights, width, label=label, **style)
        ax.bar_label(bars, labels=[fmt(h) for h in heights], fontsize=7, padding=2)
    top = max([0.0, *measured.values(), *theory.values()])
    for i, key in enumerate(keys):
        if key in measured and key in theory and theory[key]:
            ratio = measured[key] / theory[key]
            ax.annotate(
                f"{ratio:.2f}×",
                (x[i], max(measured[key], theory[key])),
                xytext=(0, 14),
                textcoords="offset points",
                ha="center",
                fontsize=9,
                fontweight="bold",
            )
    ax.set_ylim(0, top * 1.25 if top > 0 else 1)  # headroom for value and ratio labels
    if ylabel == "bytes":
        # Ticks at round numbers of the chosen unit (4, 8, 12 MiB), not round numbers of bytes.
        unit, scale = byte_unit(top)
        ticks = MaxNLocator(nbins=6).tick_values(0, top * 1.25 / scale) * scale
        ax.set_yticks(ticks[ticks <= top * 1.25])
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / scale:g} {unit}"))
    crowded = len(keys) > 4
    ax.set_xticks(x, keys, rotation=20 if crowded else 0, ha="right" if crowded else "center")
    ax.set_ylabel(ylabel)
    ax.legend(loc="best", fontsize=8, title="ratio = measured / theory", title_fontsize=8)
    ax.set_title(title or "measured vs theory")
    return fig


def plot_rank_contents(stages: dict[str, list[list[float]]], *, title: str | None = None) -> Figure:
    """Which rank holds what: one panel per stage, a row of numbered cells per rank.

    Args:
        stages: stage name (e.g. "before", "after") -> one list of values per rank; rows may
            differ in length (short rows are padded with blank cells).
        title: figure title.
    """
    if not stages:
        raise ValueError("plot_rank_contents needs at least one stage")
    # Every panel gets the same grid and the same colour scale, so a value that moved from one
    # rank to another keeps its colour and its cell size between "before" and "after".
    n_rows = max(len(rows) for rows in stages.values())
    n_cols = max([1] + [len(row) for rows in stages.values() for row in rows])
    finite = [float(v) for rows in stages.values() for row in rows for v in row]
    finite = [v for v in finite if math.isfinite(v)]
    vmin, vmax = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if vmin == vmax:
        vmin, vmax = vmin - 1, vmax + 1

    panel_w = 0.55 * n_cols + 0.4
    fig = Figure(figsize=(len(stages) * panel_w + 1.0, 0.5 * n_rows + 1.2), layout="constrained")
    axes = fig.subplots(1, len(stages), squeeze=False)[0]
    cmap = colormaps["viridis"].with_extremes(bad="white")  # padded cells are blank
    for ax, (stage, rows) in zip(axes, stages.items(), strict=True):
        grid = np.full((n_rows, n_cols), np.nan)
        for r, row in enumerate(rows):
            grid[r, : len(row)] = row
        ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=vmin, vmax=vmax, aspect="equal")
        for r, row in enumerate(rows):
            for c, v in enumerate(row):
                if not math.isfinite(float(v)):
                    continue
                # Dark text on light cells, light text on dark cells.
                shade = (float(v) - vmin) / (vmax - vmin)
                color = "white" if shade < 0.45 else "black"
                ax.text(c, r, _format_value(v), ha="center", va="center", fontsize=9, color=color)
        ax.set_xticks(np.arange(n_cols + 1) - 0.5, minor=True)
        ax.set_yticks(np.arange(n_rows + 1) - 0.5, minor=True)
        ax.grid(which="minor", color="#BBBBBB", lw=1)
        ax.tick_params(which="both", length=0)
        ax.set_xticks([])
        ax.set_yticks(range(n_rows), [f"rank {r}" for r in range(n_rows)])
        ax.set_title(stage, fontsize=10)
    if title:
        fig.suptitle(title)
    return fig


def save_figure(fig: Figure, path: str | os.PathLike) -> pathlib.Path:
    """Save `fig` as a PNG (dpi 110), creating parent directories; returns the path written.

    Args:
        fig: the figure to save.
        path: target file; ``.png`` is appended when it has no suffix.
    """
    path = pathlib.Path(path)
    if not path.suffix:
        path = path.with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png", bbox_inches="tight")
    return path


def plot_memory_vs_compute(chains: dict[str, dict], *, title: str | None = None) -> Figure:
    """Checkpointing schedules: measured peak bytes vs calls, beside the counted theory.

    Args:
        chains: the checkpoint lab's ``chains``: per N, ``rows`` (one per schedule, measured)
            and ``frontier`` (optimal(b) for every budget b, from the dynamic programme).
    """
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    measured_ax, theory_ax = fig.subplots(1, 2)
    markers = "os^Dv*P"
    for color, (n, chain) in zip(_palette(len(chains)), chains.items(), strict=True):
        for marker, row in zip(markers, chain["rows"], strict=False):
            measured_ax.scatter(
                row["forward_calls"],
                row["peak_activation_bytes"],
                color=color,
                marker=marker,
                label=f"N={n} {row['schedule']}",
            )
            theory_ax.scatter(
                row["forward_calls"], row["stored_activations"], color=color, marker=marker
            )
        front = sorted(chain["frontier"], key=lambda f: f["forward_calls"])
        theory_ax.plot(
            [f["forward_calls"] for f in front],
            [f["stored_activations"] for f in front],
            color=color,
            lw=1,
            label=f"N={n} optimal(b) frontier (DP)",
        )
    measured_ax.set(
        xscale="log",
        xlabel="layer forward calls (measured, hooks)",
        ylabel="peak activation bytes (measured, tracker)",
        title="measured",
    )
    measured_ax.yaxis.set_major_formatter(lambda v, _: format_bytes(v))
    theory_ax.set(
        xscale="log",
        xlabel="layer forward calls",
        ylabel="layer inputs kept at once",
        title="counted, with the optimal frontier",
    )
    measured_ax.legend(fontsize=6, ncol=2)
    theory_ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    return fig


def plot_rss_over_time(
    curves: dict[str, list[dict[str, Any]]],
    *,
    title: str | None = None,
    theory: dict[str, float] | None = None,
) -> Figure:
    """Resident-memory growth over time, one panel per rank, one line per way of building.

    Args:
        curves: label -> one record per rank, each ``{"t": [...], "bytes": [...]}`` (seconds
            since its own start, bytes above its own start) and optional ``"marks"``
            (``{"t", "label", "bytes"}``, drawn as dots with their label).
        title: figure title.
        theory: label -> bytes, drawn as dotted horizontal lines in every panel.
    """
    if not curves or not all(curves.values()):
        raise ValueError("plot_rss_over_time needs at least one curve with one rank")
    ranks = max(len(per_rank) for per_rank in curves.values())
    theory = theory or {}
    largest = max(
        [max(rec["bytes"] or [0]) for per_rank in curves.values() for rec in per_rank]
        + list(theory.values())
    )
    unit, scale = byte_unit(largest)
    fig = Figure(figsize=(11, 1.2 + 2.8 * ranks), layout="constrained")
    axes = fig.subplots(ranks, 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    colors = _THEORY_COLORS[1:] + _THEORY_COLORS[:1]
    for r, ax in enumerate(axes):
        for (label, per_rank), color in zip(curves.items(), _palette(len(curves)), strict=True):
            if r >= len(per_rank):
                continue
            rec = per_rank[r]
            ys = np.asarray(rec["bytes"], dtype=float) / scale
            ax.plot(rec["t"], ys, color=color, lw=1.6, drawstyle="steps-post", label=label)
            for m in rec.get("marks", []):
                ax.plot(m["t"], m["bytes"] / scale, "o", color=color, ms=4)
                ax.annotate(m["label"], (m["t"], m["bytes"] / scale), xytext=(3, 3),
                            textcoords="offset points", fontsize=7, color=color)  # fmt: skip
        for (name, value), color in zip(theory.items(), colors * len(theory), strict=False):
            ax.axhline(value / scale, color=color, ls=":", lw=1.4,
                       label=f"theory: {name} {format_bytes(value)}")  # fmt: skip
        ax.set_title(f"rank {r}", fontsize=10)
        ax.set_ylabel(f"resident memory growth ({unit})")
        ax.set_ylim(0, 1.15 * largest / scale if largest else 1)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("time since start of the build (s)")
    if title:
        fig.suptitle(title)
    return fig


def _palette(n: int) -> list:
    cmap = colormaps["viridis"]
    return [cmap(i / max(1, n - 1) * 0.85) for i in range(n)]
