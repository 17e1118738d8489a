"""Lab 05, in words: every sentence the notebook says about a measurement is built here from
the result, so that it says what this run measured (tests feed each one results that go each
way). The sentences that judge a course-note claim or a time curve are in `claims.py` (and
importable from here), the tables in `tables.py`, the figures in `pictures.py`; `summary` and
`figures` are what the CLI prints and saves.
"""

from __future__ import annotations

from typing import Any

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.pipeline.lab.analysis import LOSS_RTOL
from fsdp_lab.pipeline.lab.claims import (
    convergence_sentence,
    growth_timing_sentence,
    scaling_sentence,
)
from fsdp_lab.pipeline.lab.pictures import label
from fsdp_lab.pipeline.lab.tables import (
    convergence_table,
    growth_table,
    overlap_table,
    readme_table,
    results_table,
    scaling_table,
)
from fsdp_lab.pipeline.lab.words import join, labels, verb
from fsdp_lab.sizes import format_bytes

__all__ = [
    "convergence_sentence",
    "exactness_sentence",
    "figures",
    "growth_sentence",
    "growth_timing_sentence",
    "layout_sentence",
    "loss_sentence",
    "mesh_sentence",
    "overlap_sentence",
    "peaks_sentence",
    "readme_table",
    "scaling_sentence",
    "summary",
    "traffic_sentence",
]


def figures(result: LabResult) -> dict[str, Any]:
    """The ownership / RNG-travel diagram per strategy, loss curves, growth (memory and time),
    init time over ranks, convergence, the same-seed bug — each where the result has it."""
    from fsdp_lab.diagrams import pipeline_diagram
    from fsdp_lab.pipeline import PipeGPTConfig
    from fsdp_lab.pipeline.lab import pictures

    model_config = PipeGPTConfig(**result["model"])
    figs: dict[str, Any] = {
        f"pipeline_{s}": pipeline_diagram(
            model_config, result["stages"], strategy=s, dp=result["dp"]
        )
        for s in result["strategies"]
    }
    figs["loss_curves"] = pictures.loss_figure(result)
    if result["growth"]:
        figs["growth"] = pictures.growth_figure(result)
        figs["growth_time"] = pictures.growth_time_figure(result)
    if result["scaling"]:
        figs["scaling"] = pictures.scaling_figure(result)
    if result["convergence"]:
        figs["convergence"] = pictures.convergence_figure(result)
    same = result["strategies"].get("same_seed")
    if same is not None and same["overlap"]["samples"]:
        figs["same_seed_draws"] = pictures.same_seed_figure(result)
    return figs


# -- what the run measured, in sentences ---------------------------------------------------------


def layout_sentence(result: LabResult) -> str:
    """The measured layout: stages, pipelines, ranks, layers per stage, model and state size."""
    r = result
    spans = ", ".join(
        f"{ls[0]}-{ls[-1]}" if len(ls) > 1 else str(ls[0]) for ls in r["layers_per_stage"]
    )
    return (
        f"S = {r['stages']} stages x dp = {r['dp']} pipeline(s) on {r['world_size']} ranks "
        f"({r['backend']}); layers per stage {spans}; whole model "
        f"{format_bytes(r['full_model_bytes'])}; generator state {r['generator_state_bytes']:,} B; "
        f"{r['handoffs']} change(s) of owner in the recorded init order; init times are the "
        f"median of {r['repeats']} repeat(s)."
    )


def exactness_sentence(result: LabResult) -> str:
    """Which strategies gave every stage exactly the unsplit init's values, which did not."""
    rows = result["strategies"]
    equal = [s for s, r in rows.items() if r["bitwise_equal"]]
    differ = [s for s, r in rows.items() if not r["bitwise_equal"]]
    parts = []
    if equal:
        parts.append(
            f"{labels(equal)} {verb(equal, 'gives', 'give')} every stage exactly the unsplit "
            "init's values (`torch.equal` on every parameter, largest difference 0)"
        )
    if differ:
        diffs = join([f"{rows[s]['max_abs_diff']:.3g}" for s in differ])
        what = "" if equal else " give the stages the unsplit init's values"
        parts.append(
            f"{labels(differ)} {verb(differ, 'does', 'do')} not{what} (largest |difference| "
            f"{diffs})"
        )
    return "Measured: " + "; ".join(parts) + "."


def peaks_sentence(result: LabResult) -> str:
    """Which strategies made some rank hold the whole model while initialising."""
    whole = result["full_model_bytes"]
    rows = result["strategies"]
    held = {
        s: [i for i, p in enumerate(r["peak_bytes_per_rank"]) if p >= whole]
        for s, r in rows.items()
    }
    parts = []
    for s in (s for s in rows if held[s]):
        peak_list = rows[s]["peak_bytes_per_rank"]
        rest = [p for i, p in enumerate(peak_list) if i not in held[s]]
        ranks = join([str(i) for i in held[s]])
        text = (
            f"under {label(s)} rank{'s' if len(held[s]) > 1 else ''} {ranks} held the whole model "
            f"while initialising (peak {format_bytes(max(peak_list))}, the model "
            f"{format_bytes(whole)})"
        )
        if rest:
            text += f", the other ranks at most {format_bytes(max(rest))}"
        parts.append(text)
    light = [s for s in rows if not held[s]]
    if light:
        top = max(max(rows[s]["peak_bytes_per_rank"]) for s in light)
        parts.append(
            f"under {labels(light)} no rank's peak reached the whole model (highest "
            f"{format_bytes(top)}, {top / whole:.0%} of it)"
        )
    text = "; ".join(parts)
    return "Measured: " + text + "."


def traffic_sentence(result: LabResult) -> str:
    """What (d) sent against `theory.rng_replay_bytes`, and (a)'s file against the model."""
    rows, parts = result["strategies"], []
    replay = rows.get("rng_replay")
    if replay is not None:
        sent, theory = replay["bytes_moved"], replay["theory_bytes_moved"]
        verdict = "exactly what" if sent == theory else f"not the {theory:,} B"
        parts.append(
            f"(d) sent {sent:,} B over {result['handoffs']} change(s) of owner per pipeline, "
            f"{verdict} `theory.rng_replay_bytes` counts (one "
            f"{result['generator_state_bytes']:,} B generator state per handoff)"
        )
    ckpt = rows.get("seed_checkpoint")
    if ckpt is not None:
        parts.append(
            f"(a) sent {ckpt['bytes_moved']:,} B of messages, and its real traffic is the file: "
            f"{format_bytes(ckpt['checkpoint_file_bytes'])} on disk for a "
            f"{format_bytes(result['full_model_bytes'])} model, written once by rank 0 and read "
            "by every stage"
        )
    return ("Measured: " + "; ".join(parts) + ".") if parts else ""


def growth_sentence(result: LabResult) -> str:
    """As the model grew: whose rank-0 peak followed the whole model, who stayed below it."""
    rows = result["growth"]
    first, last = rows[0], rows[-1]
    grew = last["full_model_bytes"] / first["full_model_bytes"]
    text = (
        f"Measured: from width {first['dim']} to {last['dim']} the whole model grew {grew:.1f}x "
        f"({format_bytes(first['full_model_bytes'])} to {format_bytes(last['full_model_bytes'])})"
    )

    def whole_on_rank0(s: str) -> bool:
        return all(r[s]["peak_bytes_per_rank"][0] >= r["full_model_bytes"] for r in rows)

    follow = [s for s in result["strategies"] if whole_on_rank0(s)]
    below = [
        s
        for s in result["strategies"]
        if all(max(r[s]["peak_bytes_per_rank"]) < r["full_model_bytes"] for r in rows)
    ]
    parts = []
    for s in follow:
        peak0 = [r[s]["peak_bytes_per_rank"][0] for r in rows]
        parts.append(
            f"rank 0's peak under {label(s)} followed it at every width "
            f"({format_bytes(peak0[0])} to {format_bytes(peak0[-1])})"
        )
    if below:
        top = max(
            max(r[s]["peak_bytes_per_rank"]) / r["full_model_bytes"] for s in below for r in rows
        )
        parts.append(
            f"under {labels(below)} no rank reached the whole model at any width (at most "
            f"{top:.0%} of it)"
        )
    return text + ("; " + "; ".join(parts) if parts else "") + "."


def overlap_sentence(result: LabResult) -> str:
    """(b)'s stages against each other, and whether the other strategies' stages are distinct."""
    rows = result["strategies"]
    same = rows.get("same_seed")
    parts = []
    if same is not None and same["overlap"]["first_layer_corr_0_1"] is not None:
        o = same["overlap"]
        corr = o["first_layer_corr_0_1"]
        looks = "no visible relation" if abs(corr) < 0.1 else "a visible relation"
        fractions = o["duplicate_fraction_per_stage"][1:]
        all_repeat = all(f == 1.0 for f in fractions)
        parts.append(
            f"(b): position by position, stage 0's layer 0 and stage 1's first layer correlate "
            f"at {corr:.3f} ({looks}), yet in drawing order stage 1's first "
            f"{o['shared_prefix_values_0_1']:,} values are stage 0's first ones, and "
            + (
                "every value a later stage drew was drawn on an earlier stage"
                if all_repeat
                else f"of each later stage's values {join([f'{f:.2%}' for f in fractions])} "
                "repeat an earlier stage's"
            )
        )
        identical = o["identical_first_layers"]
        if identical:
            pairs = join([f"{a} and {b}" for a, b in identical])
            parts.append(f"the first layers of stages {pairs} are identical")
    distinct = [s for s, r in rows.items() if r["overlap"]["stages_distinct"]]
    repeating = [s for s, r in rows.items() if r["overlap"]["stages_distinct"] is False]
    if distinct:
        chance = max(rows[s]["overlap"]["duplicate_fraction"] for s in distinct)
        parts.append(
            f"{labels(distinct)}: no two consecutive values repeat an earlier stage's, so the "
            f"stages are distinct; single equal values occur by chance (at most {chance:.1e} of "
            "them)"
        )
    if repeating and repeating != ["same_seed"]:
        parts.append(f"stages repeat each other under {labels(repeating)}")
    return ("Measured: " + "; ".join(parts) + ".") if parts else ""


def loss_sentence(result: LabResult) -> str:
    """Which pipelines trained like one process (within float rounding), which did not."""
    rows = result["strategies"]
    match = [s for s, r in rows.items() if r["loss_matches_baseline"]]
    other = [s for s, r in rows.items() if not r["loss_matches_baseline"]]
    parts = []
    if match:
        worst = max(rows[s]["loss_max_rel_diff"] for s in match)
        parts.append(
            f"{labels(match)} trained like single-process training within float rounding "
            f"(largest relative difference {worst:.1e}, under rtol {LOSS_RTOL:g}: GPipe sums the "
            "micro-batches in another order)"
        )
    if other:
        gaps = join([f"{rows[s]['loss_max_rel_diff']:.1e}" for s in other])
        parts.append(
            f"{labels(other)} {verb(other, 'follows', 'follow')} other curves (largest "
            f"relative difference {gaps}): {verb(other, 'it starts', 'they start')} from "
            "other weights"
        )
    return "Measured: " + "; ".join(parts) + "."


def mesh_sentence(result: LabResult) -> str:
    """pp x dp: do the replicas of every stage agree, and are the stages distinct?"""
    rows = result["strategies"]
    agree = [s for s, r in rows.items() if r["mesh"]["replicas_equal"]]
    disagree = [s for s, r in rows.items() if r["mesh"]["replicas_equal"] is False]
    repeat = [s for s, r in rows.items() if r["mesh"]["stages_distinct"] is False]
    head = f"Measured on {result['stages']} stages x {result['dp']} pipelines: "
    parts = []
    if agree:
        parts.append(f"the replicas of every stage hold identical weights under {labels(agree)}")
    if disagree:
        parts.append(f"they differ under {labels(disagree)}")
    parts.append(
        f"the stages repeat each other under {labels(repeat)}"
        if repeat
        else "the stages are distinct under every strategy"
    )
    return head + "; ".join(parts) + "."


def summary(result: LabResult) -> str:
    """The layout, then the results, overlap, growth, scaling and convergence in Markdown."""
    r = result
    lines = [
        "pipeline seeding: " + layout_sentence(r),
        "",
        results_table(r),
        "",
        exactness_sentence(r),
        "",
        overlap_table(r),
    ]
    if r["growth"]:
        lines += ["", growth_table(r), "", growth_timing_sentence(r)]
    if r["scaling"]:
        lines += ["", scaling_table(r), "", scaling_sentence(r)]
    if r["convergence"]:
        lines += ["", convergence_table(r), "", convergence_sentence(r)]
    return "\n".join(lines)
