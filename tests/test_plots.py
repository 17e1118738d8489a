"""The figures show what was measured: stacks sum to totals, one bar per span, cells hold values."""

from __future__ import annotations

import numpy as np
import pytest
from figure_checks import problems
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

from fsdp_lab.plots import (
    CATEGORY_COLORS,
    KIND_COLORS,
    plot_measured_vs_theory,
    plot_memory_trace,
    plot_rank_contents,
    plot_rss_over_time,
    plot_timeline,
    save_figure,
)
from fsdp_lab.sizes import format_bytes

MiB = 2**20
CATS = list(CATEGORY_COLORS)


@pytest.fixture(autouse=True)
def _agg_backend(monkeypatch):
    # The plots never use pyplot, but a stray display must not be needed either.
    monkeypatch.setenv("MPLBACKEND", "Agg")


def make_trace(rank: int, scale: int = 1, n_markers: int = 2) -> dict:
    """Parameters constant, activations rising then falling, gradients appearing late."""
    t = [0.0, 0.1, 0.2, 0.3, 0.4]
    b = {c: [0] * len(t) for c in CATS}
    b["parameters"] = [4 * MiB * scale] * 5
    b["activations"] = [0, 2 * MiB * scale, 3 * MiB * scale, 1 * MiB * scale, 0]
    b["gradients"] = [0, 0, 0, 4 * MiB * scale, 4 * MiB * scale]
    total = [sum(b[c][i] for c in CATS) for i in range(len(t))]
    markers = [
        {"t": 0.4 * k / max(1, n_markers - 1), "label": f"mark {k}", "total": 0}
        for k in range(n_markers)
    ]
    return {
        "rank": rank,
        "device": "cpu",
        "source": "storages",
        "categories": CATS,
        "t": t,
        "bytes": b,
        "total": total,
        "markers": markers,
        "peak_bytes": max(total),
        "peak_by_category": {c: max(b[c]) for c in CATS},
    }


def test_format_bytes_picks_binary_units():
    assert format_bytes(1.5 * MiB) == "1.50 MiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(2048) == "2.00 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(-MiB) == "-1.00 MiB"


def test_memory_trace_stack_reaches_totals_with_markers_and_peak():
    traces = [make_trace(0), make_trace(1, scale=2)]
    fig = plot_memory_trace(traces, title="two ranks", theory={"budget": 10 * MiB})
    assert isinstance(fig, Figure)
    panels = fig.axes
    assert len(panels) == 2  # a panel per rank, no key to look numbers up in
    for ax, tr in zip(panels, traces, strict=True):
        # The top of the stack is the measured total (in MiB, the unit chosen for 16 MiB).
        tops = [p.vertices[:, 1].max() for c in ax.collections for p in c.get_paths()]
        assert max(tops) == pytest.approx(max(tr["total"]) / MiB)
        assert "MiB" in ax.get_ylabel()
        assert {t.get_text().strip() for t in ax.texts} == {"mark 0", "mark 1"}  # they fit
        dashed = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
        assert [ln.get_ydata()[0] for ln in dashed] == [pytest.approx(tr["peak_bytes"] / MiB)]
        dotted = [ln for ln in ax.lines if ln.get_linestyle() == ":"]
        assert [ln.get_ydata()[0] for ln in dotted] == [pytest.approx(10.0)]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert f"measured peak {format_bytes(tr['peak_bytes'])}" in legend
        # Categories that never hold bytes stay out of the legend.
        assert "parameters" in legend and "optimizer_state" not in legend
    assert "marked events (2)" in [t.get_text() for t in panels[0].get_legend().get_texts()]
    # Shared y axis: rank 1's 16 MiB peak sets the scale for rank 0 as well.
    assert panels[0].get_ylim() == panels[1].get_ylim()
    assert problems(fig) == []


def test_the_ranks_memory_traces_share_one_clock():
    """Issue 39: each trace counted from its own start, so rank 0 seemed done with three steps
    before rank 1 began; the timeline beside them had one clock."""
    early, late = make_trace(0), make_trace(1)
    early |= {"origin": 100.0, "host": "h"}
    late |= {"origin": 100.5, "host": "h"}  # started recording half a second later
    fig = plot_memory_trace([early, late])
    first_x = [
        min(p.vertices[:, 0].min() for p in ax.collections[0].get_paths()) for ax in fig.axes
    ]
    assert first_x == [pytest.approx(0.0), pytest.approx(0.5)]
    assert fig.axes[-1].get_xlabel() == "time since the first rank started recording (s)"
    marks = [ln.get_xdata()[0] for ln in fig.axes[1].lines if ln.get_linestyle() == "-"]
    assert min(marks) == pytest.approx(0.5)  # its markers moved with it
    assert problems(fig) == []
    # Two hosts share no clock: each keeps its own.
    fig = plot_memory_trace([early, late | {"host": "other"}])
    assert fig.axes[-1].get_xlabel() == "time since start (s)"


def test_a_model_state_formula_is_set_beside_the_model_state_peak_not_the_total():
    tr = make_trace(0)  # model state peaks at 8 MiB (parameters + gradients), total at 9 MiB
    fig = plot_memory_trace(tr, theory={"formula": 8 * MiB}, compare="model_state")
    dashed = [ln for ln in fig.axes[0].lines if ln.get_linestyle() == "--"]
    assert [ln.get_ydata()[0] for ln in dashed] == [pytest.approx(8.0)]
    with pytest.raises(ValueError, match="compare='bytes'"):
        plot_memory_trace(tr, compare="bytes")


def test_many_markers_are_ticks_without_labels_and_nothing_overlaps():
    tr = make_trace(0, n_markers=200)
    fig = plot_memory_trace(tr)
    (ax,) = fig.axes
    ticks = [ln for ln in ax.lines if ln.get_xdata()[0] == ln.get_xdata()[1]]
    assert len(ticks) >= 200  # every marker keeps its tick...
    assert len(ax.texts) == 0  # ...but 200 labels cannot be read: none is drawn
    assert problems(fig) == []


def test_step_markers_shade_each_steps_phases():
    tr = make_trace(0, n_markers=0)
    tr["markers"] = [
        {"t": t, "label": f"step {k} {what}"}
        for k, base in ((0, 0.0), (1, 0.2))
        for t, what in ((base + 0.08, "forward done"), (base + 0.15, "backward done"),
                        (base + 0.19, "optimizer step"))
    ]  # fmt: skip
    tr["total"] = tr["total"]
    fig = plot_memory_trace(tr, compare="model_state")
    (ax,) = fig.axes
    spans = [p for p in ax.patches if p.get_width() > 0 and p.get_height() > 0]
    assert len(spans) == 6  # forward, backward, optimizer step, twice
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"forward", "backward", "optimizer step"} <= set(legend)
    # The model state's peak (8 MiB) and everything's (9 MiB, activations too) both named.
    assert "peak of model state (what the formula counts) 8.00 MiB" in legend
    assert "peak of everything measured 9.00 MiB" in legend
    assert problems(fig) == []


def timelines() -> list[dict]:
    def spans(origin: float) -> list[dict]:
        return [
            {
                "kind": "comm",
                "name": "all_gather",
                "start": origin,
                "end": origin + 0.4,
                "bytes": 8,
            },
            {
                "kind": "compute",
                "name": "fwd",
                "start": origin + 0.3,
                "end": origin + 0.8,
                "bytes": 0,
            },
            {"kind": "comm", "name": "rs", "start": origin + 0.8, "end": origin + 0.81, "bytes": 8},
        ]

    # Rank 1's clock has a different origin: the plot aligns each rank to its first span.
    return [{"rank": 0, "spans": spans(0.0)}, {"rank": 1, "spans": spans(100.0)}]


def test_timeline_one_bar_per_span_in_separate_lanes():
    tls = timelines()
    fig = plot_timeline(tls, title="t")
    (ax,) = fig.axes
    bars = [p for c in ax.collections for p in c.get_paths()]
    assert len(bars) == sum(len(tl["spans"]) for tl in tls)
    # Lane of each kind, per rank: compute and comm never share a row.
    lanes: dict[str, set[float]] = {"compute": set(), "comm": set()}
    for c in ax.collections:
        (kind,) = [
            k for k, col in KIND_COLORS.items() if np.allclose(c.get_facecolor()[0], to_rgba(col))
        ]
        lanes[kind] |= {round(float(p.vertices[:, 1].mean()), 3) for p in c.get_paths()}
    assert len(lanes["comm"]) == 2 and len(lanes["compute"]) == 2
    assert lanes["comm"].isdisjoint(lanes["compute"])
    # Both ranks start at x = 0 (aligned separately), and the axis is in ms for a run under 1 s.
    starts = sorted(round(float(p.vertices[:, 0].min()), 6) for p in bars)
    assert starts[:2] == [0.0, 0.0]
    assert "ms" in ax.get_xlabel() and "aligned" in ax.get_xlabel()
    # The wide all-gather is labelled; the 10 ms reduce-scatter is too narrow for its name.
    names = [t.get_text() for t in ax.texts]
    assert names.count("all_gather") == 2 and "rs" not in names


def test_measured_vs_theory_bars_equal_inputs_and_ratio_shown():
    measured = {"params": 4 * MiB, "grads": 4.2 * MiB, "peak": 12 * MiB}
    theory = {"params": 4 * MiB, "grads": 4 * MiB, "activations": 2 * MiB}
    fig = plot_measured_vs_theory(measured, theory)
    (ax,) = fig.axes
    solid = [p.get_height() for p in ax.patches if not p.get_hatch()]
    hatched = [p.get_height() for p in ax.patches if p.get_hatch()]
    assert solid == pytest.approx(list(measured.values()))
    assert hatched == pytest.approx(list(theory.values()))
    texts = [t.get_text() for t in ax.texts]
    assert "1.00×" in texts and "1.05×" in texts
    assert len([t for t in texts if t.endswith("×")]) == 2  # only keys present in both
    assert "4.20 MiB" in texts  # value labels in human units
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "params",
        "grads",
        "peak",
        "activations",
    ]


def test_measured_vs_theory_plain_units():
    fig = plot_measured_vs_theory({"t": 0.5}, {"t": 0.25}, ylabel="seconds")
    (ax,) = fig.axes
    assert ax.get_ylabel() == "seconds"
    assert "2.00×" in [t.get_text() for t in ax.texts]


def test_rank_contents_one_panel_per_stage_with_values_in_cells():
    stages = {
        "before": [[0], [1], [2]],
        "after all_gather": [[0, 1, 2]] * 3,
        "after reduce_scatter": [[0.5], [1.25], [2]],
    }
    fig = plot_rank_contents(stages, title="collectives")
    assert [ax.get_title() for ax in fig.axes] == list(stages)
    for ax, rows in zip(fig.axes, stages.values(), strict=True):
        cells = [t.get_text() for t in ax.texts]
        assert cells == [str(v).removesuffix(".0") for row in rows for v in row]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
        image = ax.images[0].get_array()
        assert image.shape == (3, 3)  # short rows padded to the widest stage
        assert int(np.ma.count_masked(image)) == sum(3 - len(row) for row in rows)
    # Same value, same colour across panels: all panels share one colour scale.
    assert len({ax.images[0].get_clim() for ax in fig.axes}) == 1


def test_save_figure_writes_png(tmp_path):
    fig = plot_measured_vs_theory({"a": 1.0}, {"a": 2.0}, ylabel="x")
    out = save_figure(fig, tmp_path / "deep" / "dir" / "fig")
    assert out == tmp_path / "deep" / "dir" / "fig.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_rss_over_time_one_panel_per_rank_curves_as_given_theory_lines():
    def rank(peak: int) -> dict:
        marks = [{"t": 0.1, "label": "built", "bytes": peak * MiB}]
        return {"t": [0.0, 0.1, 0.2], "bytes": [0, peak * MiB, 10 * MiB], "marks": marks}

    curves = {"ordinary": [rank(64), rank(63)], "meta": [rank(20), rank(21)]}
    fig = plot_rss_over_time(curves, title="spike vs flat", theory={"model": 64 * MiB})
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    for r, ax in enumerate(fig.axes):
        lines = {line.get_label(): line for line in ax.get_lines()}
        for label, per_rank in curves.items():  # the y values are the inputs, in MiB
            np.testing.assert_allclose(
                lines[label].get_ydata(), np.array(per_rank[r]["bytes"]) / MiB
            )
        theory = lines["theory: model 64.00 MiB"]
        assert list(theory.get_ydata()) == [64, 64] and theory.get_linestyle() == ":"
        assert ax.get_title() == f"rank {r}" and "MiB" in ax.get_ylabel()
        assert len(ax.texts) == 0 and "at: built" in lines  # a shape per mark, in the legend
    assert problems(fig) == []


def test_rss_over_time_needs_a_curve():
    with pytest.raises(ValueError, match="at least one curve"):
        plot_rss_over_time({})
    with pytest.raises(ValueError, match="at least one curve"):
        plot_rss_over_time({"ordinary": []})


def test_timeline_draws_waiting_apart_and_a_phase_as_a_band_over_what_it_holds():
    def span(kind, name, start, end, group=""):
        return {
            "kind": kind,
            "name": name,
            "start": start,
            "end": end,
            "bytes": 0,
            "group": group,
            "tag": "blocks.0" if kind == "comm" else "",
        }

    r0 = {
        "rank": 0,
        "origin": 0.0,
        "host": "h",
        "spans": [
            span("compute", "forward", 0.0, 1.0),
            span("compute", "forward blocks.0", 0.2, 0.6),
            span("comm", "all_gather_into_tensor", 0.1, 0.9, "world"),
        ],
    }
    r1 = {
        "rank": 1,
        "origin": 0.0,
        "host": "h",
        "spans": [
            span("compute", "load batch", 0.05, 0.09),  # rank 1 is running from 0.05 s on
            span("comm", "all_gather_into_tensor", 0.5, 0.9, "world"),
        ],
    }
    fig = plot_timeline([r0, r1])
    (ax,) = fig.axes
    heights = sorted(
        round(float(np.ptp(p.vertices[:, 1])), 2) for c in ax.collections for p in c.get_paths()
    )
    # rank 0: the phase as a band, its unit's forward, 0.4 s waiting + 0.4 s moving; rank 1: its
    # compute and its moving
    assert heights == [0.14, 0.8, 0.8, 0.8, 0.8, 0.8]
    hatched = [c for c in ax.collections if c.get_hatch()]
    assert len(hatched) == 1  # rank 0 waited from 0.1 s to 0.5 s, when rank 1 called it
    assert np.ptp(hatched[0].get_paths()[0].vertices[:, 0]) == pytest.approx(400)  # ms
    assert "one clock" in ax.get_xlabel()
    labels = {t.get_text() for t in ax.texts}
    assert "AG blocks.0" in labels and "fwd blocks.0" in labels


def test_a_long_run_is_drawn_by_its_last_step_and_lanes_only_where_spans_are():
    def step(origin: float) -> list[dict]:
        return [
            {"kind": "compute", "name": "forward", "start": origin, "end": origin + 0.3},
            {"kind": "compute", "name": "forward blocks.0", "start": origin + 0.1,
             "end": origin + 0.3},
            {"kind": "comm", "name": "all_reduce", "start": origin + 0.3, "end": origin + 0.5},
        ]  # fmt: skip

    tl = {"rank": 0, "origin": 0.0, "host": "h", "spans": step(0.0) + step(1.0) + step(2.0)}
    fig = plot_timeline(tl)
    (ax,) = fig.axes
    assert "the last of 3 steps" in ax.get_xlabel()
    assert ax.get_xlim()[1] == pytest.approx(0.5 * 1e3 * 1.01)  # one step, in ms
    comm_only = {"rank": 0, "spans": [s for s in tl["spans"] if s["kind"] == "comm"]}
    (ax,) = plot_timeline(comm_only).axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0 comm"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "comm: moving bytes",
        "comm: waiting for other ranks",
    ]


def test_a_verdicts_bytes_axis_has_round_ticks_in_one_unit_and_says_which():
    """A memory curve in a verdict: ticks at round numbers of one binary unit, the unit in the
    axis name (ticks of raw bytes read 1.95 / 3.91 / 5.86 KiB), whole ticks along x."""
    from fsdp_lab.exercise import series_of
    from fsdp_lab.plots import plot_expected_got

    series = series_of(
        "gathered",
        "event, in order",
        "memory",
        {"reference": [0, 8000, 4000], "yours": [0, 8000, 8000]},
        in_bytes=True,
    )
    fig = plot_expected_got(series)
    fig.canvas.draw()
    (ax,) = fig.axes
    assert ax.get_ylabel() == "memory (KiB)"
    ticks = [float(t.get_text().replace("−", "-")) for t in ax.get_yticklabels() if t.get_text()]
    assert ticks and all(t == round(t) for t in ticks), ticks
    assert max(ax.lines[1].get_ydata()) == 8000 / 1024  # the values, in that unit
    assert not problems(fig)
