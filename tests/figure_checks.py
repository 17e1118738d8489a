"""What a reader of a figure can trip over, found with matplotlib's own renderer: two pieces of
text drawn on top of each other, a legend over bars, a title cut at the figure's edge, a step
axis ticking at fractions of a step."""

from __future__ import annotations

from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.legend import Legend
from matplotlib.patches import Rectangle
from matplotlib.text import Text


def _texts(fig: Any) -> list[tuple[str, Text]]:
    """Every visible, non-empty text of the figure, named for the message, legends as one."""
    found: list[tuple[str, Text]] = [
        (f"figure text {t.get_text()!r}", t) for t in fig.texts if t is not fig._suptitle
    ]
    if fig._suptitle is not None:
        found.append(("suptitle", fig._suptitle))
    for i, ax in enumerate(fig.axes):
        found += [(f"axes {i} text {t.get_text()!r}", t) for t in ax.texts]
        for what, t in (("title", ax.title), ("left title", ax._left_title),
                        ("right title", ax._right_title), ("xlabel", ax.xaxis.label),
                        ("ylabel", ax.yaxis.label)):  # fmt: skip
            found.append((f"axes {i} {what}", t))
        for axis in (ax.xaxis, ax.yaxis):  # the ticks inside the view: those drawn
            lo, hi = sorted(axis.get_view_interval())
            found += [
                (f"axes {i} tick {label.get_text()!r}", label)
                for tick, label in zip(
                    axis.get_majorticklocs(), axis.get_ticklabels(), strict=False
                )
                if lo - 1e-9 <= tick <= hi + 1e-9
            ]
    return [(n, t) for n, t in found if t.get_visible() and t.get_text().strip()]


def problems(fig: Any) -> list[str]:
    """Overlapping texts (legends count as one box each), legends over bars, text running
    past the figure's edge."""
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    boxes = [(n, t.get_window_extent(renderer)) for n, t in _texts(fig)]
    legends = [a.get_legend() for a in fig.axes if a.get_legend() is not None] + [
        child for child in fig.get_children() if isinstance(child, Legend)
    ]
    boxes += [(f"legend {i}", leg.get_window_extent(renderer)) for i, leg in enumerate(legends)]
    out = []
    for i, (a_name, a) in enumerate(boxes):
        for b_name, b in boxes[i + 1 :]:
            if a.overlaps(b) and a.width * a.height > 0 and b.width * b.height > 0:
                inter = min(a.x1, b.x1) - max(a.x0, b.x0), min(a.y1, b.y1) - max(a.y0, b.y0)
                if inter[0] > 1 and inter[1] > 1:  # touching by a pixel is not overlapping
                    out.append(f"{a_name} overlaps {b_name}")
    edge = fig.bbox
    for name, box in boxes:
        if box.x0 < edge.x0 - 1 or box.x1 > edge.x1 + 1 or box.y1 > edge.y1 + 1:
            out.append(f"{name} runs past the figure's edge")
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        lbox = legend.get_window_extent(renderer)
        bars = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_height() != 0]
        for p in bars:
            pbox = p.get_window_extent(renderer)
            if lbox.overlaps(pbox) and min(lbox.x1, pbox.x1) - max(lbox.x0, pbox.x0) > 1:
                out.append(f"the legend of {ax.get_title()!r} covers a bar")
                break
    return out


def fractional_ticks(ax: Any) -> list[float]:
    """x tick positions that are not whole numbers (on an axis of steps, ranks, ...)."""
    lo, hi = ax.get_xlim()
    return [t for t in ax.get_xticks() if lo <= t <= hi and abs(t - round(t)) > 1e-9]
