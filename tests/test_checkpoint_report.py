"""Lab 02's sentences follow the numbers: each comparative sentence of `report` and `textbook`
fed results where the comparison goes one way, then the other; the explorer's table and its
figures read one recording; the memory-vs-compute figure's legend and ticks."""

from __future__ import annotations

import copy
import re

from fsdp_lab.checkpointing.lab import report
from fsdp_lab.labs.contract import LabResult


def row(schedule: str, n: int, kept: int, calls: int, peak: int, times=(1.0, 2.0, 3.0)) -> dict:
    """A measured row as `measure_schedules` makes it (times in ms: min, median, max)."""
    t_min, t_med, t_max = (t / 1e3 for t in times)
    return {
        "schedule": schedule,
        "n": n,
        "stored_activations": kept,
        "forward_calls": calls,
        "theory_stored_activations": kept,
        "theory_forward_calls": calls,
        "time_s": t_med,
        "time_min_s": t_min,
        "time_max_s": t_max,
        "repeats": 5,
        "peak_activation_bytes": peak,
        "peak_total_bytes": peak + 100,
        "max_abs_grad_diff": 0.0,
    }


KIB = 1024


def chains_result() -> LabResult:
    """Two chains, with counts as the schedules really make them at N = 16 and 32."""
    rows = {
        16: [
            row("store_all", 16, 16, 16, 1056 * KIB),
            row("full_recompute", 16, 2, 136, 160 * KIB),
            row("every(4)", 16, 5, 52, 256 * KIB),
            row("segments(4)", 16, 7, 28, 384 * KIB),
            row("optimal(7)", 16, 7, 27, 480 * KIB),
            row("revolve(6)", 16, 7, 40, 320 * KIB),
        ],
        32: [
            row("store_all", 32, 32, 32, 2080 * KIB),
            row("full_recompute", 32, 2, 528, 160 * KIB),
            row("every(6)", 32, 7, 128, 320 * KIB),
            row("segments(6)", 32, 10, 62, 576 * KIB),
            row("optimal(10)", 32, 10, 57, 672 * KIB),
            row("revolve(9)", 32, 10, 85, 416 * KIB),
        ],
    }
    versus = {
        "k": 4,
        "store_all_peak_activation_bytes": 1200 * KIB,
        "ours_peak_activation_bytes": 388 * KIB,
        "torch_peak_activation_bytes": 388 * KIB,
        "peak_ratio_ours_to_torch": 1.0,
        "max_abs_grad_diff_ours_vs_torch": 0.0,
    }
    data = {
        "config": {"batch": 256, "dim": 32},
        "chains": {str(n): {"rows": r, "versus_torch": dict(versus)} for n, r in rows.items()},
        "schedules": {
            str(n): {
                x["schedule"]: {"peak_activation_bytes": x["peak_activation_bytes"]} for x in r
            }
            for n, r in rows.items()
        },
        "binomial_law": [
            {
                "snapshots": 2,
                "repetitions": 2,
                "at": {"steps": 6, "advances": 8, "repetitions": 2, "theory_advances": 8}
                | {"theory_repetitions": 2, "stored_activations": 3},
                "past": {"steps": 7, "advances": 11, "repetitions": 3, "theory_advances": 11}
                | {"theory_repetitions": 3, "stored_activations": 3},
            }
        ],
        "with_sharding": {
            mode: {
                "units": 4,
                "world_size": 2,
                "all_gather_calls_per_step": gathers,
                "theory_all_gather_calls_per_step": gathers,
                "all_gather_bytes_per_step": 256.0 * gathers,
                "max_abs_param_diff_vs_plain": 0.0,
            }
            for mode, gathers in (
                ("plain", 8.0),
                ("unit_wraps_checkpoint", 8.0),
                ("checkpoint_spans_two_units", 10.0),
            )
        },
    }
    return LabResult("checkpoint", data)


def changed(result: LabResult, n: int, schedule: str, **values) -> LabResult:
    out = copy.deepcopy(result)
    (r,) = [r for r in out["chains"][str(n)]["rows"] if r["schedule"] == schedule]
    r.update(values)
    return out


# -- report: the measured runs ------------------------------------------------------------------


def test_timing_note_claims_an_order_only_where_the_runs_do_not_overlap():
    base = row("store_all", 16, 16, 16, 0, times=(2, 3, 4))
    overlapping = row("segments(4)", 16, 7, 28, 0, times=(3.5, 5, 9))
    slower = row("every(4)", 16, 5, 52, 0, times=(8, 9, 12))
    faster = row("optimal(7)", 16, 7, 27, 0, times=(0.5, 1, 1.5))
    note = report.timing_note([base, overlapping, slower, faster])
    assert "`segments(4)`: cannot be told apart from `store_all`" in note
    assert "slower than `store_all`, in median time: `every(4)` 3.0×" in note
    assert "measured *faster* than `store_all`: `optimal(7)` (27 layer calls to 16)" in note
    # Store-all slower than a recompute: said as measured, never hidden or reversed.
    slow_base = row("store_all", 16, 16, 16, 0, times=(8, 9, 12))
    flipped = report.timing_note([slow_base, row("segments(4)", 16, 7, 28, 0, times=(2, 3, 4))])
    assert "measured *faster* than `store_all`: `segments(4)` (28 layer calls to 16)" in flipped
    assert "slower" not in flipped and "cannot be told apart" not in flipped
    assert report.timing_note([base]) == ""


def test_activation_growth_says_two_tensors_per_layer_only_when_measured():
    result = chains_result()  # 1056 KiB at 16, 2080 KiB at 32: 2 × 32 KiB per layer, + 1
    text = report.activation_growth(result)
    assert "each extra layer adds 2.00 tensors — two, as the theory says" in text
    assert "on top sit 1.00 tensors" in text
    result.data["schedules"]["32"]["store_all"]["peak_activation_bytes"] = 2592 * KIB  # 3/layer
    text = report.activation_growth(result)
    assert "adds 3.00 tensors — not the two the theory expects" in text


def test_gradient_note_says_bit_for_bit_only_when_every_difference_is_zero():
    result = chains_result()
    assert "bit for bit" in report.gradient_note(result)
    worse = changed(result, 32, "every(6)", max_abs_grad_diff=3e-7)
    text = report.gradient_note(worse)
    assert "Not every run matched" in text and "3.0e-07 (N = 32, `every(6)`)" in text


def test_versus_torch_note_follows_the_ratio_the_gradients_and_store_all():
    result = chains_result()
    text = report.versus_torch_note(result)
    assert "the same peak bytes as torch's at every N" in text
    assert "bit for bit" in text and "reads higher here than in the schedule table" in text
    v = result["chains"]["32"]["versus_torch"]
    v.update(peak_ratio_ours_to_torch=1.25, max_abs_grad_diff_ours_vs_torch=1e-6)
    for chain in result["chains"].values():
        chain["versus_torch"]["store_all_peak_activation_bytes"] = 100
    text = report.versus_torch_note(result)
    assert "between 1.000 and 1.250× torch's peak bytes" in text
    assert "gradients within 1.0e-06" in text and "reads no higher" in text


def test_sharding_note_follows_the_all_gather_counts_and_the_parameters():
    result = chains_result()
    text = report.sharding_note(result)
    assert "same parameters, bit for bit" in text
    assert "`unit_wraps_checkpoint` made as many all-gathers as `plain`" in text
    assert "`checkpoint_spans_two_units` made 2 more all-gathers per step" in text
    runs = result["with_sharding"]
    runs["unit_wraps_checkpoint"]["all_gather_calls_per_step"] = 6.0
    runs["checkpoint_spans_two_units"]["max_abs_param_diff_vs_plain"] = 1e-3
    text = report.sharding_note(result)
    assert "`unit_wraps_checkpoint` made 2 fewer" in text and "did not end with identical" in text


def test_explorer_note_follows_the_bytes():
    base, other = row("store_all", 8, 8, 8, 512 * KIB), row("segments(3)", 8, 4, 14, 256 * KIB)
    assert "`segments(3)` held less activation memory than `store_all` (0.50×) for 1.75×" in (
        report.explorer_note([base, other])
    )
    other["peak_activation_bytes"] = 1024 * KIB
    assert "held more activation memory than `store_all` (2.00×)" in report.explorer_note(
        [base, other]
    )


# -- textbook: the sources' table against the measurement ---------------------------------------


def test_textbook_verdicts_on_counts_as_the_schedules_make_them():
    text = report.textbook_verdicts(chains_result())
    assert "mixes two schemes" in text
    # a checkpoint every k layers, rerun once per segment: the segments row's own counts
    first = text.splitlines()[0]
    assert "`segments(4)` kept 7 inputs for 28 calls at N = 16" in first and "under 2N" in first
    assert "3.25·N calls at N = 16" in text and "4.00·N calls at N = 32" in text
    assert "the calls per layer grew with N" in text
    assert "under 2N calls at every N" in text and "one extra forward at most, O(N)" in text
    assert '"Theoretically optimal" is wrong' in text and "fewer calls at N = 16, 32" in text


def test_textbook_verdicts_turn_with_the_numbers():
    result = changed(chains_result(), 32, "every(6)", forward_calls=80)  # 2.50·N < 3.25·N
    result = changed(result, 32, "segments(6)", forward_calls=70)  # over 2N
    result = changed(result, 16, "optimal(7)", forward_calls=28)  # as many as segments
    result = changed(result, 32, "optimal(10)", forward_calls=70)
    text = report.textbook_verdicts(result)
    assert "did not grow with N" in text and "grew with N" not in text
    assert "not under 2N calls everywhere" in text and "more than one extra forward" in text
    assert "under 2N" not in text.splitlines()[0] and "more measured here" in text
    assert "is wrong" not in text and "made no fewer calls than segments(k)" in text


def test_frontier_in_bytes_compares_at_equal_kept_inputs_both_ways():
    result = chains_result()
    text = report.frontier_in_bytes(result)
    assert "`optimal(7)` made fewer calls (27 vs 28) and held more activation memory" in text
    assert "`optimal(10)` made fewer calls (57 vs 85) and held more" in text
    less = changed(result, 16, "optimal(7)", peak_activation_bytes=300 * KIB)
    text = report.frontier_in_bytes(less)
    assert "(27 vs 28) and held less activation memory (300.00 KiB vs 384.00 KiB)" in text
    unequal = changed(result, 16, "segments(4)", stored_activations=6)
    assert "`segments(4)`" not in report.frontier_in_bytes(unequal)  # not at equal kept inputs


def test_binomial_note_follows_the_hooks():
    result = chains_result()
    assert "the hooks saw the law" in report.binomial_note(result)
    assert "the advances equal" in report.binomial_note(result)
    result.data["binomial_law"][0]["past"]["repetitions"] = 2
    result.data["binomial_law"][0]["at"]["advances"] = 9
    text = report.binomial_note(result)
    assert "did not see the law everywhere" in text and "differ from t" in text
    assert "| 2 | 2 | 6 | 9 (8) · 2 (2) | 2 (3) |" in report.binomial_table(result)


def test_the_corrected_table_sets_each_formula_beside_the_measured_run():
    text = report.corrected_table(chains_result())
    assert "| every(C): C checkpoints, N/C layers apart | C + 1 — O(C) |" in text
    assert "`segments(6)`: 10 · 62 · 576.00 KiB" in text
    assert "O(N√N)" not in text  # the wrong compute is the sources', not ours
    assert "theoretically optimal" in report.SOURCES_TABLE


# -- one recording for the explorer's table and figures; the memory-vs-compute figure -------------


def test_the_explorers_peaks_are_the_figures_peaks():
    # The explorer once showed two "peaks" for one run: the table's activations-only peak
    # and the figure's dashed line over activations + gradients, from another recording.
    from fsdp_lab.checkpointing.lab.explorer import CheckpointExplorer
    from fsdp_lab.sizes import format_bytes

    explorer = CheckpointExplorer(n=6, schedule="revolve", arg=2, dim=8, batch=8)
    text, *figs = explorer.draw()
    rows = explorer.last_rows
    assert [r["schedule"] for r in rows] == ["store_all", "revolve(2)"] and len(figs) == 2
    for r, fig in zip(rows, figs, strict=True):
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        (dashed,) = [label for label in labels if "peak" in label]  # the dashed line's
        assert dashed.endswith(f"peak {format_bytes(r['peak_total_bytes'])}")
        assert format_bytes(r["peak_total_bytes"]) in text.data
        assert r["time_min_s"] <= r["time_s"] <= r["time_max_s"] and r["repeats"] > 1
        assert r["forward_calls"] == r["theory_forward_calls"]
    assert "median" in text.data and "under the memory tracker" in text.data


def test_memory_vs_compute_has_short_legends_and_round_binary_ticks():
    from fsdp_lab.plots import plot_memory_vs_compute

    result = chains_result()
    for chain in result["chains"].values():
        chain["frontier"] = [{"forward_calls": 40, "stored_activations": 3}]
    fig = plot_memory_vs_compute(result["chains"])
    fig.canvas.draw()
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:2] == ["N = 16", "N = 32"]  # colour per N, shape per schedule: 2 + 6 + 2
    assert "segments(k)" in labels and "revolve(s)" in labels and len(labels) == 10
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels() if t.get_text()]
    assert ticks and all(re.fullmatch(r"\d+ (B|KiB|MiB)", t) for t in ticks), ticks
    assert "128 KiB" in ticks and "2 MiB" in ticks


def test_every_measured_row_is_one_point_at_its_calls_and_bytes():
    from fsdp_lab.plots import plot_memory_vs_compute

    chains = chains_result()["chains"]
    fig = plot_memory_vs_compute(chains)
    points = {tuple(c.get_offsets()[0]) for c in fig.axes[0].collections}
    rows = [r for chain in chains.values() for r in chain["rows"]]
    assert points == {(r["forward_calls"], r["peak_activation_bytes"]) for r in rows}


def test_regime_sentence_says_which_dominates_both_ways():
    wide = LabResult("checkpoint", {"config": {"batch": 256, "dim": 32}})
    assert "activations, not weights, dominate" in report.regime_sentence(wide)
    narrow = LabResult("checkpoint", {"config": {"batch": 64, "dim": 128}})  # the CLI's defaults
    text = report.regime_sentence(narrow)
    assert "activations do not dominate here" in text and "16,512" in text
