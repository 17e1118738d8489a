"""Pictures of measurements: memory over time, compute/communication timelines, theory checks.

(Over 400 lines on purpose: one function per kind of figure, sharing the colours, byte axes and
marker rules defined at the top; split, a learner would meet two colour schemes.)

What it teaches: a number is easier to believe when you can see it. Every lab measures something
(bytes held per category, spans of compute and communication, tensors held by each rank) and
these functions draw the measurement next to the theory, in the way PyTorch's memory snapshot
viewer and profiler traces do for real FSDP runs, reduced to what a lesson needs.

The functions take plain dicts and lists (the exported form of `fsdp_lab.trace` records), so
they can be used on saved JSON; from the rest of the package they import only `sizes` and the
trace's own definitions (which categories are model state, which spans wait). Each returns a
`matplotlib.figure.Figure` built without pyplot: no global figure state, so a notebook shows a
figure once (as the cell's value) and re-running a cell does not leak figures.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator

from fsdp_lab.outputs import write_file
from fsdp_lab.sizes import byte_unit, format_bytes
from fsdp_lab.trace.memory import MODEL_STATE

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
# One colour per system compared (ours and PyTorch's, the strategies), from the same palette.
SYSTEM_COLORS: dict[str, str] = {
    "full": "#4C72B0",
    "hybrid": "#DD8452",
    "hybrid_zero2": "#55A868",
    "ours": "#4C72B0",
    "fsdp2": "#DD8452",
    "fsdp1": "#8172B3",
    "ddp": "#937860",
}
_THEORY_COLORS = ["#2F2F2F", "#8C564B", "#17BECF", "#BCBD22", "#E377C2"]


def _format_value(v: float) -> str:
    """Integers without a decimal point (rank ids, element values), others to 3 digits."""
    return str(int(v)) if float(v).is_integer() else f"{v:.3g}"


def _rank_title(record: dict[str, Any], index: int) -> str:
    rank = record.get("rank")
    return f"rank {rank}" if rank is not None else f"process {index}"


def on_one_clock(traces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks' memory traces on one time axis, as their timelines are drawn: each counts
    from its own start (`origin`, a system-wide monotonic reading on one host), so each is
    moved by how much later than the first rank's its start was. Traces from several hosts
    share no clock and stay as they are."""
    from fsdp_lab.trace.timeline import common_clock

    if len(traces) < 2 or not common_clock(traces):
        return traces
    first = min(tr["origin"] for tr in traces)
    return [
        {
            **tr,
            "t": [t + tr["origin"] - first for t in tr["t"]],
            "markers": [{**m, "t": m["t"] + tr["origin"] - first} for m in tr.get("markers", [])],
        }
        for tr in traces
    ]


def plot_memory_trace(
    traces: dict | list[dict],
    *,
    title: str | None = None,
    theory: dict[str, float] | None = None,
    compare: str = "total",
) -> Figure:
    """Stacked memory by category over time, one panel per rank, with phases and the peak.

    Markers named like a training step ("step 2 forward done", "step 2 backward done", "step 2
    optimizer step") shade each step's forward, backward and optimizer phases; every other
    marker is a short tick at the top of the panel — a few are labelled where their label fits,
    none overlapping (the timeline names every event). With ``compare="model_state"`` the
    dashed line is the peak of what a model-state formula counts, and a thin solid line the
    peak of everything measured, so neither reads as the other.

    Args:
        traces: one exported memory trace (dict) or a list of them, one per rank.
        title: figure title.
        theory: label -> bytes, drawn as dotted horizontal lines beside the measurement.
        compare: which measured peak the dashed line shows, like with like against `theory`:
            "total" (everything) or "model_state" (`MODEL_STATE`: parameters, gradients,
            optimizer state and gathered buffers — no activations, no "other").
    """
    traces = [traces] if isinstance(traces, dict) else list(traces)
    if not traces:
        raise ValueError("plot_memory_trace needs at least one trace")
    placed = on_one_clock(traces)
    clock = "since the first rank started recording" if placed is not traces else "since start"
    traces = placed
    if compare not in ("total", "model_state"):
        raise ValueError(f"compare={compare!r}: expected 'total' or 'model_state'")
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
        total_peak = tr.get("peak_bytes", max(tr.get("total") or [0]))
        if len(t):
            # step="post": a storage lives at its size until the next event, it does not ramp.
            ax.stackplot(t, *ys, labels=labels, colors=colors, step="post", linewidth=0)
            # The total as a thin outline: a storage made and freed inside one operator (two
            # samples at one instant) has no width in the stack, but it is a real peak.
            total = np.asarray(tr.get("total") or np.sum(ys, axis=0) * scale, dtype=float)
            ax.step(t, total / scale, where="post", color="black", lw=0.5, alpha=0.7)
        if compare == "model_state":
            kept = [np.asarray(tr["bytes"][c], dtype=float) for c in cats if c in MODEL_STATE]
            peak = float(np.max(np.sum(kept, axis=0))) if kept and len(t) else 0.0
            what = "peak of model state (what the formula counts)"
            if total_peak > peak:
                ax.axhline(total_peak / scale, color="#555555", lw=0.8,
                           label=f"peak of everything measured {format_bytes(total_peak)}")  # fmt: skip
        else:
            peak, what = total_peak, "measured peak"
        ax.axhline(
            peak / scale, color="black", ls="--", lw=1.0, label=f"{what} {format_bytes(peak)}"
        )
        for j, (name, value) in enumerate(theory.items()):
            color = _THEORY_COLORS[j % len(_THEORY_COLORS)]
            label = f"theory: {name} {format_bytes(value)}"
            ax.axhline(value / scale, color=color, ls=":", lw=1.6, label=label)
        source = tr.get("source", "")
        ax.set_title(f"{_rank_title(tr, i)}  ({tr.get('device', '?')}, {source})", fontsize=10)
        ax.set_ylabel(f"memory ({unit})")
        # Headroom above the peak: the lane where the ticks and labels sit.
        ax.set_ylim(0, 1.3 * largest / scale if largest else 1)
    for ax, tr in zip(axes, traces, strict=True):  # after the x range is set by every panel
        _draw_markers(ax, tr.get("markers", []), first=ax is axes[0], t0=min(tr["t"] or [0.0]))
        # The legend goes outside the axes so it never hides the stack.
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    axes[-1].set_xlabel(f"time {clock} (s)")
    if title:
        fig.suptitle(title)
    return fig


_STEP = re.compile(r"^step (\d+) (forward done|backward done|optimizer step)$")
PHASE_COLORS = {"forward": "#4C72B0", "backward": "#C44E52", "optimizer step": "#55A868"}
_LANE_ROWS = (0.965, 0.9)  # axes fractions of the label lane, top down


def _draw_markers(ax: Any, markers: Sequence[dict[str, Any]], first: bool, t0: float) -> None:
    """Each step's forward, backward and optimizer phases shaded (from the "step k ..."
    markers); every other marker a short tick at the top, labelled only where the label fits
    beside its neighbours (no key to look numbers up in)."""
    steps: dict[int, dict[str, float]] = {}
    events = []
    for m in sorted(markers, key=lambda m: m["t"]):
        match = _STEP.match(m["label"])
        if match:
            steps.setdefault(int(match.group(1)), {})[match.group(2)] = m["t"]
        else:
            events.append(m)
    start = t0  # the first forward begins with the trace
    shown: set[str] = set()
    for k in sorted(steps):
        ends = steps[k]
        for phase, begin_key, end_key in (
            ("forward", None, "forward done"),
            ("backward", "forward done", "backward done"),
            ("optimizer step", "backward done", "optimizer step"),
        ):
            a = ends.get(begin_key, start) if begin_key else start
            b = ends.get(end_key)
            if b is None or b <= a:
                continue
            label = phase if phase not in shown and first else f"_{phase}"
            shown.add(phase)
            ax.axvspan(a, b, color=PHASE_COLORS[phase], alpha=0.1, lw=0, label=label)
        start = ends.get("optimizer step", start)
    if events:
        for m in events:
            ax.axvline(m["t"], ymin=0.93, ymax=1.0, color="#555555", lw=0.6)
        ax.axvline(events[0]["t"], ymin=0.93, ymax=1.0, color="#555555", lw=0.6,
                   label=f"marked events ({len(events)})" if first else "_events")  # fmt: skip
        _label_events(ax, events if len(events) <= 12 else [])


def _label_events(ax: Any, events: Sequence[dict[str, Any]]) -> None:
    """A label beside each tick — to its right, else to its left — in the first lane row where
    it touches no other label; a label with no room is left out (its tick stays)."""
    x0, x1 = ax.get_xlim()
    width_in = ax.get_figure().get_size_inches()[0] * 0.7  # the panel's share of the width
    taken: list[list[tuple[float, float]]] = [[] for _ in _LANE_ROWS]
    for m in events:
        pos = (m["t"] - x0) / (x1 - x0) if x1 > x0 else 0.0
        width = (len(m["label"]) * 0.55 * 7 / 72 + 0.08) / width_in
        for row, spans in enumerate(taken):
            for a, b, ha in ((pos, pos + width, "left"), (pos - width, pos, "right")):
                if a >= 0 and b <= 1 and all(b <= c or a >= d for c, d in spans):
                    spans.append((a, b))
                    ax.text(m["t"], _LANE_ROWS[row] - 0.06, f" {m['label']} ", ha=ha,
                            transform=ax.get_xaxis_transform(), va="center", fontsize=7,
                            color="#333333")  # fmt: skip
                    break
            else:
                continue
            break


_OP_SHORT = {
    "all_gather_into_tensor": "AG",
    "reduce_scatter_tensor": "RS",
    "all_reduce": "AR",
    "broadcast": "BC",
    "send": "send",
    "recv": "recv",
}
_WAIT_COLOR = "#F3D9C4"  # a pale comm colour, hatched: inside a collective, not yet moving


def plot_timeline(timelines: dict | list[dict], *, title: str | None = None) -> Figure:
    """Gantt chart of compute and communication spans, two lanes per rank so overlap shows.

    Comm spans are split in two: *waiting* (pale, hatched) until the last rank of the group
    has entered the collective — no byte can move before — and *transfer* (solid) after it
    (`trace.timeline.waiting_times`). Spans are labelled by op and unit where they are wide
    enough ("AG blocks.0": the all-gather of unit blocks.0; "fwd blocks.0" its forward).
    Ranks of one host share one clock; otherwise each is aligned to its own first span.

    Args:
        timelines: one exported timeline ``{"rank", "spans"}`` or a list, one per rank.
        title: figure title.
    """
    from fsdp_lab.trace.timeline import common_clock, waiting_times

    timelines = [timelines] if isinstance(timelines, dict) else list(timelines)
    if not timelines:
        raise ValueError("plot_timeline needs at least one timeline")
    shared = common_clock(timelines)
    starts = [
        (tl["origin"] if shared else 0.0) + min((s["start"] for s in tl["spans"]), default=0.0)
        for tl in timelines
    ]
    t_first = min(starts)
    # Each rank's offset on the common axis: its own origin (shared clock) or its first span.
    offsets = [
        tl["origin"] - t_first if shared else -start
        for tl, start in zip(timelines, starts, strict=True)
    ]
    waits = waiting_times(timelines)
    duration = max(
        (s["end"] + o for tl, o in zip(timelines, offsets, strict=True) for s in tl["spans"]),
        default=0.0,
    )
    # The window: a run of several steps is shown by its last one, where the spans are wide
    # enough to read (the steps repeat); else from the moment every rank had begun, so the
    # wait of the first collective for a rank still starting does not fill the axis.
    steps = [
        [s["start"] + o for s in tl["spans"] if s["name"] == "forward"]
        for tl, o in zip(timelines, offsets, strict=True)
    ]
    if all(len(st) > 1 for st in steps):
        t_lo = min(st[-1] for st in steps)
        shown = f"the last of {min(len(st) for st in steps)} steps"
    else:
        t_lo = max(min((s["start"] + o for s in tl["spans"]), default=0.0)
                   for tl, o in zip(timelines, offsets, strict=True))  # fmt: skip
        shown = "from the moment every rank had begun"
    span = max(duration - t_lo, 1e-12)
    unit, scale = ("s", 1.0) if span >= 1 else ("ms", 1e3) if span >= 1e-3 else ("µs", 1e6)
    full = max(span * scale, 1e-9)
    # Lanes that hold something: a lab of collectives alone has no compute lane.
    lanes = tuple(k for k in ("compute", "comm") if any(s["kind"] == k for tl in timelines
                                                        for s in tl["spans"]))  # fmt: skip

    fig = Figure(figsize=(11, 1.1 + 0.45 * len(lanes) * len(timelines)), layout="constrained")
    ax = fig.subplots()
    ticks, tick_labels = [], []
    for i, (tl, o) in enumerate(zip(timelines, offsets, strict=True)):
        name = _rank_title(tl, i)
        base = len(lanes) * i
        if i:
            ax.axhline(base - 0.5, color="#999999", lw=0.8)  # separates one rank from the next
        for lane_index, kind in enumerate(lanes):
            y = base + lane_index  # rank i's compute lane sits right above its comm lane
            ticks.append(y)
            tick_labels.append(f"{name} {kind}")
            phases = _enclosing(tl["spans"], kind)
            labelled: list[tuple[float, float]] = []  # this lane's labels, left to right
            for s, wait, phase in zip(tl["spans"], waits[i], phases, strict=True):
                if s["kind"] != kind or s["end"] + o <= t_lo:
                    continue
                x0 = (max(s["start"] + o, t_lo) - t_lo) * scale
                x1 = (s["end"] + o - t_lo) * scale
                if phase:  # a span holding others ("forward" around each unit's): a thin band
                    ax.broken_barh(
                        [(x0, x1 - x0)], (y - 0.48, 0.14), facecolors="#9DB3D6", edgecolor="none"
                    )
                    continue
                xw = max(x0, (s["start"] + o + wait - t_lo) * scale)
                if xw > x0:
                    ax.broken_barh(
                        [(x0, xw - x0)],
                        (y - 0.4, 0.8),
                        facecolors=_WAIT_COLOR,
                        edgecolor="white",
                        lw=0.5,
                        hatch="///",
                    )
                ax.broken_barh(
                    [(xw, x1 - xw)],
                    (y - 0.4, 0.8),
                    facecolors=KIND_COLORS[kind],
                    edgecolor="white",
                    lw=0.5,
                )
                _label_span(ax, _span_label(s), xw, x1 - xw, y, full, labelled)
    ax.set_yticks(ticks, tick_labels, fontsize=8)
    if not ticks:  # no rank recorded a span: say so rather than draw an empty axis
        ax.text(0.5, 0.5, "no spans were recorded", ha="center", va="center",
                transform=ax.transAxes, color="#555555")  # fmt: skip
    ax.set_ylim(max(len(ticks), 1) - 0.5, -0.5)  # rank 0 on top, like a profiler trace
    ax.set_xlim(0, full * 1.01)
    clock = "one clock for all ranks" if shared else "each rank aligned to its first span"
    ax.set_xlabel(f"time ({unit}; {clock}; {shown})")
    ax.grid(axis="x", alpha=0.3)
    handles = []  # only what is drawn
    if "compute" in lanes:
        handles += [Patch(color="#9DB3D6", label="phase (forward, backward)"),
                    Patch(color=KIND_COLORS["compute"], label="compute")]  # fmt: skip
    if "comm" in lanes:
        handles += [Patch(color=KIND_COLORS["comm"], label="comm: moving bytes"),
                    Patch(facecolor=_WAIT_COLOR, hatch="///", label="comm: waiting for other ranks")]  # fmt: skip
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=4, fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


def _enclosing(spans: list[dict[str, Any]], kind: str) -> list[bool]:
    """Per span: whether it is a phase that encloses other spans of its `kind` (the whole
    forward around each unit's forward). Drawn as a band, it no longer hides what it holds."""
    own = [(s["start"], s["end"]) for s in spans if s["kind"] == kind]
    return [
        s["kind"] == kind
        and any(
            s["start"] <= a and b <= s["end"] and (a, b) != (s["start"], s["end"]) for a, b in own
        )
        for s in spans
    ]


def _span_label(span: dict[str, Any]) -> str:
    """ "AG blocks.0" for a comm span with a tag, "fwd blocks.0" for a unit's forward."""
    if span["kind"] == "comm":
        return " ".join(
            x for x in (_OP_SHORT.get(span["name"], span["name"]), span.get("tag")) if x
        )
    return span["name"].replace("forward ", "fwd ").replace("backward ", "bwd ")


def _label_span(
    ax: Any, label: str, x: float, width: float, y: float, full: float, taken: list
) -> None:
    """Write `label` inside a span wide enough to hold it, unless another label of the lane
    (`taken`: their x extents) is there already — async spans of one lane can overlap."""
    # At fontsize 7 on an 11-inch figure a character takes about 0.5% of the axis width.
    need = (0.005 * len(label) + 0.004) * full
    if not label or full <= 0 or width <= need:
        return
    lo, hi = x + width / 2 - need / 2, x + width / 2 + need / 2
    if any(lo < b and a < hi for a, b in taken):
        return
    taken.append((lo, hi))
    ax.text(x + width / 2, y, label, ha="center", va="center", fontsize=7, clip_on=True)


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
    # More than four keys, or long ones: horizontal bars, labels read left to right, not slanted.
    across = len(keys) > 4 or max(map(len, keys), default=0) > 14
    size = (9.0, 1.2 + 0.5 * len(keys)) if across else (max(5.0, 1.4 * len(keys) + 3), 4.2)
    fig = Figure(figsize=size, layout="constrained")
    ax = fig.subplots()
    width = 0.38
    x = np.arange(len(keys))
    # Bars keep the raw values (heights are the inputs); only the tick labels are humanised.
    measured_style = {"color": "#4C72B0"}
    theory_style = {"facecolor": "white", "edgecolor": "#4C72B0", "hatch": "//"}
    draw = ax.barh if across else ax.bar
    for label, values, offset, style in (
        ("measured", measured, -width / 2, measured_style),
        ("theory", theory, width / 2, theory_style),
    ):
        idx = [i for i, k in enumerate(keys) if k in values]  # a missing key gets no bar
        heights = [values[keys[i]] for i in idx]
        bars = draw(x[idx] + offset, heights, width, label=label, **style)
        ax.bar_label(bars, labels=[fmt(h) for h in heights], fontsize=7, padding=2)
    top = max([0.0, *measured.values(), *theory.values()])
    for i, key in enumerate(keys):
        if key in measured and key in theory and theory[key]:
            ratio = measured[key] / theory[key]
            # The ratio sits past the value labels: to the right of the rows, or above the pair.
            where = (top * 1.3, x[i]) if across else (x[i], max(measured[key], theory[key]))
            ax.annotate(
                f"{ratio:.2f}×",
                where,
                xytext=(0, 0) if across else (0, 14),
                textcoords="offset points",
                ha="left" if across else "center",
                va="center" if across else "baseline",
                fontsize=9,
                fontweight="bold",
            )
    value_axis = ax.xaxis if across else ax.yaxis
    (ax.set_xlim if across else ax.set_ylim)(0, top * (1.5 if across else 1.25) if top > 0 else 1)
    if ylabel == "bytes":
        # Ticks at round numbers of the chosen unit (4, 8, 12 MiB), not round numbers of bytes.
        unit, scale = byte_unit(top)
        ticks = MaxNLocator(nbins=6).tick_values(0, top * 1.25 / scale) * scale
        (ax.set_xticks if across else ax.set_yticks)(ticks[ticks <= top * 1.25])
        value_axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / scale:g} {unit}"))
    if across:
        ax.set_yticks(x, keys)
        ax.invert_yaxis()  # the first key on top, as it was listed
        ax.set_xlabel(ylabel)
    else:
        ax.set_xticks(x, keys)
        ax.set_ylabel(ylabel)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
              title="ratio = measured / theory", title_fontsize=8)  # fmt: skip
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
    write_file(path, lambda f: fig.savefig(f, dpi=110, format="png", bbox_inches="tight"))
    return path


def plot_memory_vs_compute(chains: dict[str, dict], *, title: str | None = None) -> Figure:
    """Checkpointing schedules: measured peak bytes vs calls, beside the counted theory.

    Colour is the chain length N, marker shape the schedule: two short legends instead of one
    entry per (N, schedule). Both axes are log base 2, bytes ticked in round binary units.

    Args:
        chains: the checkpoint lab's ``chains``: per N, ``rows`` (one per schedule, measured),
            ``frontier`` (optimal(b) for every budget b) and optionally ``revolve_frontier``
            (revolve(s) for every s).
    """
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, NullLocator

    fig = Figure(figsize=(12, 5.2), layout="constrained")
    measured_ax, theory_ax = fig.subplots(1, 2)
    families = ("store_all", "full_recompute", "every", "segments", "optimal", "revolve")
    shapes = dict(zip(families, "osD^v*", strict=True))
    colors = dict(zip(chains, _palette(len(chains)), strict=True))
    shown: dict[str, str] = {}  # family -> its legend label, e.g. "segments(k)"
    for n, chain in chains.items():
        for row in chain["rows"]:
            family = row["schedule"].split("(")[0]
            arg = {"every": "C", "segments": "k", "optimal": "b", "revolve": "s"}.get(family)
            shown[family] = f"{family}({arg})" if arg else family
            style = {"color": colors[n], "marker": shapes.get(family, "X"), "s": 45}
            measured_ax.scatter(row["forward_calls"], row["peak_activation_bytes"], **style)
            theory_ax.scatter(row["forward_calls"], row["stored_activations"], **style)
        for key, ls in (("frontier", "-"), ("revolve_frontier", "--")):
            front = sorted(chain.get(key, []), key=lambda f: f["forward_calls"])
            theory_ax.plot(
                [f["forward_calls"] for f in front],
                [f["stored_activations"] for f in front],
                color=colors[n],
                lw=1,
                ls=ls,
            )
    all_calls = [r["forward_calls"] for c in chains.values() for r in c["rows"]]
    all_bytes = [r["peak_activation_bytes"] for c in chains.values() for r in c["rows"]]
    powers = range(math.floor(math.log2(min(all_calls))), math.ceil(math.log2(max(all_calls))) + 1)
    for ax in (measured_ax, theory_ax):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator([2.0**p for p in powers]))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0f}"))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(2.0 ** powers[0] / 1.2, 2.0 ** powers[-1] * 1.2)  # both end ticks shown
        ax.grid(alpha=0.3)
    # Bytes: log base 2, a tick at every power of two ("128 KiB", "1 MiB"), no odd decimals.
    low, high = math.floor(math.log2(min(all_bytes))), math.ceil(math.log2(max(all_bytes)))
    measured_ax.set_yscale("log", base=2)
    measured_ax.yaxis.set_major_locator(FixedLocator([2.0**p for p in range(low, high + 1)]))
    measured_ax.yaxis.set_minor_locator(NullLocator())
    measured_ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _binary_round(v)))
    measured_ax.set_ylim(2.0**low / 1.1, 2.0**high * 1.1)
    measured_ax.set(
        xlabel="layer forward calls (counted by hooks)",
        ylabel="peak activation bytes (measured by the tracker)",
        title="measured: memory against compute",
    )
    theory_ax.set(
        xlabel="layer forward calls",
        ylabel="layer inputs kept at once",
        title="counted, with the optimal frontiers (in kept inputs, not bytes)",
    )
    by_n = [Line2D([], [], color=c, marker="o", ls="", label=f"N = {n}") for n, c in colors.items()]
    by_schedule = [
        Line2D([], [], color="#444444", marker=shapes.get(f, "X"), ls="", label=label)
        for f, label in shown.items()
    ]
    lines = [
        Line2D([], [], color="#444444", lw=1, label="optimal(b), every b: fewest calls"),
        Line2D([], [], color="#444444", lw=1, ls="--", label="revolve(s), every s"),
    ]
    fig.legend(
        handles=by_n + by_schedule + lines,
        loc="outside lower center",
        ncol=5,
        fontsize=9,
        frameon=False,
    )
    if title:
        fig.suptitle(title)
    return fig


def _binary_round(v: float) -> str:
    """A power of two in bytes as a round binary size: 131072 -> "128 KiB" (for the ticks of
    `plot_memory_vs_compute`)."""
    unit, scale = byte_unit(v)
    return f"{v / scale:g} {unit}"


_MARK_SHAPES = ("o", "s", "^", "D", "v")


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
            (``{"t", "label", "bytes"}``: a shape per label, in the curve's colour, the shapes
            named in the legend — labels written beside the curves fell on each other).
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
    marks = dict.fromkeys(
        m["label"] for per_rank in curves.values() for rec in per_rank for m in rec.get("marks", [])
    )
    for r, ax in enumerate(axes):
        for (label, per_rank), color in zip(curves.items(), _palette(len(curves)), strict=True):
            if r >= len(per_rank):
                continue
            rec = per_rank[r]
            ys = np.asarray(rec["bytes"], dtype=float) / scale
            ax.plot(rec["t"], ys, color=color, lw=1.6, drawstyle="steps-post", label=label)
            for m in rec.get("marks", []):  # a shape per mark, named once in the legend
                shape = _MARK_SHAPES[list(marks).index(m["label"]) % len(_MARK_SHAPES)]
                ax.plot(m["t"], m["bytes"] / scale, shape, color=color, ms=5, mec="black", mew=0.5)
        for (name, value), color in zip(theory.items(), colors * len(theory), strict=False):
            ax.axhline(value / scale, color=color, ls=":", lw=1.4,
                       label=f"theory: {name} {format_bytes(value)}")  # fmt: skip
        for k, label in enumerate(marks):  # the shapes' key, in the legend
            ax.plot([], [], _MARK_SHAPES[k % len(_MARK_SHAPES)], color="white", mec="black",
                    label=f"at: {label}")  # fmt: skip
        ax.set_title(f"rank {r}", fontsize=10)
        ax.set_ylabel(f"resident memory growth ({unit})")
        ax.set_ylim(0, 1.15 * largest / scale if largest else 1)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("time since start of the build (s)")
    if title:
        fig.suptitle(title)
    return fig


def plot_expected_got(series: dict[str, Any]) -> Figure:
    """Curves the reference produced beside the learner's (a check's verdict): a memory trace
    that never drops, a loss that drifts. `series`: {"title", "xlabel", "ylabel",
    "lines": {name: [values]}, "bytes": bool (y axis in bytes)}; the first line is the
    reference, drawn solid, the others dashed over it. The x axis counts (steps, events):
    whole ticks only; bytes are drawn in one binary unit, named beside the y axis's name, so the
    ticks fall on round numbers of it; the title wraps rather than runs off; the legend sits
    beside the axes."""
    import textwrap

    fig = Figure(figsize=(8.0, 3.2), layout="constrained")
    ax = fig.add_subplot()
    ylabel, scale = series.get("ylabel", ""), 1
    marked = max((len(v) for v in series["lines"].values()), default=0) <= 20  # all lines, or none
    if series.get("bytes"):
        unit, scale = byte_unit(
            max((max(v, default=0) for v in series["lines"].values()), default=0)
        )
        ylabel = f"{ylabel} ({unit})"
    for i, (name, values) in enumerate(series["lines"].items()):
        ax.plot(
            range(len(values)),
            [v / scale for v in values],
            label=name,
            color=_THEORY_COLORS[i % len(_THEORY_COLORS)] if i else "#4C72B0",
            linestyle="-" if i == 0 else "--",
            marker="o" if marked else None,
        )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(textwrap.fill(series.get("title", ""), 75), fontsize=10)
    ax.set_xlabel(textwrap.fill(series.get("xlabel", ""), 80))
    ax.set_ylabel(ylabel)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return fig


def _palette(n: int) -> list:
    cmap = colormaps["viridis"]
    return [cmap(i / max(1, n - 1) * 0.85) for i in range(n)]
