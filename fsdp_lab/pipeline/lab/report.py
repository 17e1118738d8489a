"""Lab 05, in words: every sentence and table the notebook, the CLI's summary and docs/labs.md
show about a measurement is built here from the result, so that it says what this run measured
(tests feed each one results that go each way): the sentences, the claims of the course notes
judged against the run, the tables, and `summary`. The figures are in `figures.py`.

(Over 450 lines on purpose: it is the lab's one home for words, read top to bottom in the order
the notebook says them; split by output type it was four modules that imported each other.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fsdp_lab import measured
from fsdp_lab.choices import SEEDING_STRATEGIES as STRATEGIES
from fsdp_lab.labs.contract import LabResult
from fsdp_lab.markdown import table
from fsdp_lab.pipeline.lab.config import LOSS_RTOL, MIN_SEEDS
from fsdp_lab.sizes import format_bytes

# The course note's "exact seeding": every rank draws its own values, and together they are the
# unsplit init — (d). (a) holds the unsplit init too, but by sync: rank 0 draws everything and
# the others load it (notebook 05, section 4). The O(1) claim is judged on these only.
EXACT_SEEDING = ("rng_replay",)


def label(strategy: str) -> str:
    """The strategy with the letter the notebook and docs/labs.md give it: (a) ... (d)."""
    return f"({'abcd'[STRATEGIES.index(strategy)]}) {strategy}"


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


def join(items: list[str]) -> str:
    """ "a", "a and b", "a, b and c"."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def labels(strategies: list[str]) -> str:
    """ "(a) seed_checkpoint and (d) rng_replay"."""
    return join([label(s) for s in strategies])


def verb(items: list[Any], one: str, many: str) -> str:
    """The verb form that agrees with how many `items` there are."""
    return one if len(items) == 1 else many


YES = {True: "yes", False: "no", None: "-"}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def peaks(peaks: list[int]) -> tuple[str, str]:
    """Rank 0's peak, and the highest of the other ranks' ("-" on one rank)."""
    return format_bytes(peaks[0]), format_bytes(max(peaks[1:])) if len(peaks) > 1 else "-"


def stage_table(model_config: Any, stages: int) -> str:
    """Which modules each stage (rank, in one pipeline) owns."""
    from fsdp_lab.pipeline import stage_module_names  # torch: only when asked

    return table(
        ["stage", "rank", "modules"],
        ([s, s, ", ".join(stage_module_names(model_config, s, stages))] for s in range(stages)),
    )


def results_table(result: LabResult) -> str:
    """One Markdown row per strategy: equal to the unsplit init?, memory, time, bytes, loss."""
    head = ["strategy", "bitwise = unsplit", "max abs diff", "peak rank 0", "peak other ranks"]
    head += ["init time (median)", "bytes moved", "messages", "final loss", "loss = baseline"]
    return table(
        head,
        (
            [label(s), YES[row["bitwise_equal"]], f"{row['max_abs_diff']:.3g}"]
            + [*peaks(row["peak_bytes_per_rank"]), ms(row["init_time_s"])]
            + [f"{row['bytes_moved']:,.0f} B", row["messages"], f"{row['final_loss']:.4f}"]
            + [f"{YES[row['loss_matches_baseline']]} (max rel diff {row['loss_max_rel_diff']:.1e})"]
            for s, row in result["strategies"].items()
        ),
    )


def overlap_table(result: LabResult) -> str:
    """Per strategy: how much the stages repeat each other's draws, and whether replicas agree."""

    def num(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    head = ["strategy", "corr(stage 0 layer 0, stage 1 first layer)"]
    head += ["corr(stage 1, stage 2 first layers)", "identical first layers"]
    head += ["shared prefix, stages 0/1", "values repeating an earlier stage's"]
    head += ["stages distinct", "replicas equal (dp)"]
    rows = []
    for strategy, row in result["strategies"].items():
        o, mesh = row["overlap"], row["mesh"]
        same = ", ".join(f"{a}={b}" for a, b in o["identical_first_layers"]) or "none"
        fractions = ", ".join(num(f, ".2e") for f in o["duplicate_fraction_per_stage"][1:]) or "-"
        rows.append(
            [label(strategy), num(o["first_layer_corr_0_1"], ".3f")]
            + [num(o["first_layer_corr_1_2"], ".3f"), same]
            + [num(o["shared_prefix_values_0_1"], ","), fractions]
            + [num(o["stages_distinct"], ""), num(mesh["replicas_equal"], "")]
        )
    return table(head, rows)


def loss_table(result: LabResult) -> str:
    """Per strategy: final loss beside single-process training's, and the largest gap."""
    base = result["baseline"]["final_loss"]
    return table(
        ["strategy", "final loss", "single process", "max rel diff", f"within rtol {LOSS_RTOL:g}"],
        (
            [label(s), f"{row['final_loss']:.5f}", f"{base:.5f}"]
            + [f"{row['loss_max_rel_diff']:.1e}", YES[row["loss_matches_baseline"]]]
            for s, row in result["strategies"].items()
        ),
    )


def mesh_table(result: LabResult) -> str:
    """pp x dp: per strategy, replicas equal?, stages distinct?, the unsplit init?, bytes."""
    return table(
        ["strategy", "replicas equal", "stages distinct", "bitwise = unsplit", "bytes moved"]
        + ["loss = baseline"],
        (
            [label(s), YES[row["mesh"]["replicas_equal"]], YES[row["mesh"]["stages_distinct"]]]
            + [YES[row["bitwise_equal"]], f"{row['bytes_moved']:,} B"]
            + [YES[row["loss_matches_baseline"]]]
            for s, row in result["strategies"].items()
        ),
    )


def growth_table(result: LabResult) -> str:
    """Per width: the whole model, and per strategy rank 0's peak / the others', the median
    init time of the pipeline."""
    strategies = list(result["strategies"])
    head = ["dim", "whole model"] + [f"{label(s)} peak rank 0 / others, time" for s in strategies]

    def cell(r: dict[str, Any]) -> str:
        rank0, others = peaks(r["peak_bytes_per_rank"])
        return f"{rank0} / {others}, {ms(r['init_time_s'])}"

    return table(
        head,
        (
            [row["dim"], format_bytes(row["full_model_bytes"])] + [cell(row[s]) for s in strategies]
            for row in result["growth"]
        ),
    )


def scaling_table(result: LabResult) -> str:
    """Per rank count: each strategy's pipeline init time and its busiest rank's CPU time."""
    strategies = result["scaling"]["strategies"]
    head = ["ranks"] + [f"{label(s)} wall / CPU" for s in strategies]

    def cell(costs: dict[str, Any]) -> str:
        return f"{ms(costs['init_time_s'])} / {ms(max(costs['cpu_time_s_per_rank']))}"

    return table(
        head,
        ([row["ranks"]] + [cell(row[s]) for s in strategies] for row in result["scaling"]["rows"]),
    )


def convergence_table(result: LabResult) -> str:
    """Per seed: the final loss from the unsplit and from the same-seed init, and their gap."""
    conv = result["convergence"]
    rows: Iterable[list[Any]] = (
        [seed, f"{a:.4f}", f"{b:.4f}", f"{b - a:+.4f}"]
        for seed, a, b in zip(
            conv["seeds"], conv["final"]["unsplit"], conv["final"]["same_seed"], strict=True
        )
    )
    return table(["seed", "unsplit init", "(b) same_seed init", "same_seed - unsplit"], rows)


def refusals_table(refusals: list[tuple[dict[str, Any], str]]) -> str:
    """Settings and the message each was refused with."""
    return table(
        ["setting", "refused with"],
        (
            [", ".join(f"{k}={v!r}" for k, v in kwargs.items()), message]
            for kwargs, message in refusals
        ),
    )


def readme_table(result: LabResult) -> str:
    """docs/labs.md's table: only what does not move between runs of the same command (no times,
    no peaks) — bitwise equality, bytes and messages, loss equality."""

    def sent(s: str, row: dict[str, Any]) -> str:
        text = f"{row['bytes_moved']:,} B in {row['messages']} message(s)"
        if s == "rng_replay":
            text += f" = {result['handoffs']} handoff(s) x {result['generator_state_bytes']:,} B"
        if s == "seed_checkpoint":
            text += f" + the {format_bytes(row['checkpoint_file_bytes'])} file"
        return text

    return table(
        ["", "bitwise = unsplit", "sent while initialising", "stages distinct"]
        + [f"loss = 1 process (rtol {LOSS_RTOL:g})"],
        (
            [label(s), YES[row["bitwise_equal"]], sent(s, row), YES[row["mesh"]["stages_distinct"]]]
            + [YES[row["loss_matches_baseline"]]]
            for s, row in result["strategies"].items()
        ),
    )


_DID = {"grows": "grew", "falls": "fell", "flat": "stayed flat"}
_ONE_AT_A_TIME = {"rng_replay": "the stages draw them in turn under (d)"}  # by construction


def scaling_sentence(result: LabResult) -> str:
    """The claim "exact seeding makes init O(1) in the number of nodes", read as "the init time
    does not grow with the ranks", against the exact strategies' measured init time."""
    scaling = result["scaling"]
    rows, trends = scaling["rows"], scaling["trends"]
    if not trends:
        return "Measured on one number of ranks only: there is no trend to set against the claim."
    lo, hi = scaling["judged_ranks"]
    at = {row["ranks"]: row for row in rows}
    moved = "; ".join(
        f"{label(s)} {ms(at[lo][s]['init_time_s'])} -> {ms(at[hi][s]['init_time_s'])} "
        f"({_DID[t['wall']]}, {t['wall_ratio']:.2f}x)"
        for s, t in trends.items()
    )
    text = (
        f"Measured, the pipeline's init time (its slowest rank) on {lo} and on {hi} ranks: "
        f"{moved} (a move counts only beyond {measured.MARGIN:.0%} and beyond the spread of "
        "the repeats)."
    )
    exact = [s for s in EXACT_SEEDING if s in trends]
    flat = [s for s in exact if trends[s]["wall"] == "flat"]
    fell = [s for s in exact if trends[s]["wall"] == "falls"]
    grew = [s for s in exact if trends[s]["wall"] == "grows"]
    if flat:
        who = join([_ONE_AT_A_TIME[s] for s in flat])
        text += (
            f" The claim holds for {labels(flat)} here: {verb(flat, 'its', 'their')} init time "
            "did not grow with the ranks — nor did it fall, as the unsplit init's draws are "
            f"still made one at a time ({who})."
        )
    if fell:
        text += (
            f" For {labels(fell)} the init time fell with the ranks: better than the claim "
            "promises."
        )
    if grew:
        ratios = join([f"{trends[s]['wall_ratio']:.2f}x" for s in grew])
        text += (
            f" The claim fails for {labels(grew)}: {verb(grew, 'its', 'their')} init time grew "
            f"with the ranks ({ratios})."
        )
    first, last = rows[0]["ranks"], rows[-1]["ranks"]
    cpu = "; ".join(
        f"{label(s)} {t['cpu_ratio']:.2f}x (all ranks together {t['total_cpu_ratio']:.2f}x)"
        for s, t in trends.items()
    )
    text += f" The busiest rank's CPU time from {first} to {last} ranks: {cpu}."
    cores = result["cores"]
    if cores is not None and last > cores:
        text += (
            f" Above {cores} ranks the ranks share {cores} cores: those counts are drawn but not "
            "judged, since their wall time also measures turns on the cores (CPU time does not)."
        )
    return text


def convergence_sentence(result: LabResult) -> str:
    """The claim "same seed on every stage harms convergence" against the trainings on the
    learnable task: shown only when the paired 95 % interval of the difference excludes 0."""
    c = result["convergence"]
    k, diffs = len(c["seeds"]), c["diffs"]
    setting = f"Measured ({k} seed{'s' if k > 1 else ''}, {c['steps']} steps each)"
    floor = (
        f" The unsplit init ended between {min(c['final']['unsplit']):.3f} and "
        f"{max(c['final']['unsplit']):.3f}; the task's floor is {c['entropy_floor']:.3f}, "
        f"guessing gives ln V = {c['uniform_loss']:.3f}."
    )
    along = ", ".join(f"step {end} {gap:+.4f}" for end, gap in c["gap_along"])
    floor += f" The gap (same_seed - unsplit, mean over seeds) along the run: {along}."
    interval = c.get("interval")
    if interval is None:
        return (
            f"{setting}: the same-seed init ended {c['mean_diff']:+.4f} from the unsplit init; "
            "with one seed there is nothing to judge it by (run at least "
            f"{MIN_SEEDS} seeds)." + floor
        )
    lo, hi = interval
    stated = (
        f"the same-seed init ended {c['mean_diff']:+.4f} from the unsplit init on average "
        f"({min(diffs):+.4f} to {max(diffs):+.4f} seed by seed); paired by seed, the 95 % "
        f"interval of that difference (Student's t, {k - 1} degrees of freedom) is "
        f"[{lo:+.4f}, {hi:+.4f}]"
    )
    if c["harm_shown"]:
        return (
            f"{setting}: {stated}, above 0: here the same seed on every stage did harm "
            "convergence." + floor
        )
    if c["help_shown"]:
        return f"{setting}: {stated}, below 0: here it did not harm convergence — it helped." + (
            floor
        )
    why = (
        "which includes 0: this run cannot tell the same-seed init from the unsplit one"
        if lo <= 0 <= hi
        else f"but {k} seeds are fewer than the {MIN_SEEDS} a verdict needs here (a sample "
        "this small can look tight by luck)"
    )
    return f"{setting}: inconclusive — {stated}, {why}; more seeds narrow the interval." + floor


def first_call_sentence(result: LabResult) -> str:
    """What a strategy's first call in a fresh rank process cost against its measured calls."""
    first = result["first_call"]
    slow = {s: f for s, f in first.items() if f["ratio"] > 1 + measured.MARGIN}
    if not slow:
        return (
            " Each strategy's first call in the rank processes (a warm-up, not kept) took no "
            f"more than {1 + measured.MARGIN:.2f}x its measured median: first calls cost nothing "
            "extra here."
        )
    worst = max(slow, key=lambda s: slow[s]["ratio"])
    w = slow[worst]
    most = f"{w['ratio']:.1f}x: {ms(w['first_s'])} against {ms(w['median_s'])}"
    if len(slow) > 1:
        most = f"up to {most} for {label(worst)}"
    return (
        " The first call in the rank processes (a warm-up, not kept) took longer than the "
        f"measured median for {labels(list(slow))} — {most}: first calls pay one-time costs, "
        "which is why every measurement starts with one."
    )


def growth_timing_sentence(result: LabResult) -> str:
    """Whether the init-time curve has a hump (time falling while the model grows), whether the
    work (CPU time) has it too or only the waiting, and how far the repeats of one init lay."""
    timing = result["growth_timing"]
    wall = {s: d for s, d in timing["dips"]["wall"].items() if d}
    cpu = {s: d for s, d in timing["dips"]["cpu"].items() if d}
    tol = f"{measured.MARGIN:.0%}"

    def where(dips: dict[str, list[list[int]]]) -> str:
        return join(
            [
                f"{label(s)} (width {', '.join(f'{a} -> {b}' for a, b in d)})"
                for s, d in dips.items()
            ]
        )

    spread = (
        f" The {result['repeats']} repeats of one init lay up to {timing['repeat_spread']:.1f}x "
        f"apart in wall time ({result['world_size']} ranks on {result['cores']} cores)."
    ) + first_call_sentence(result)
    if not wall:
        return (
            "Measured: no hump — as the model grew, no strategy's init time fell from one width "
            f"to the next by more than {tol} and beyond the spread of its repeats." + spread
        )
    text = (
        f"Measured: a hump — the wall time fell as the model grew (by more than {tol}, and "
        f"beyond the spread of the repeats), for {where(wall)}."
    )
    if not cpu:
        text += (
            " The busiest rank's CPU time has no such dip: the work grew with the model, so the "
            "hump is waiting (for a core, or for another rank), not work."
        )
    else:
        text += (
            f" The CPU time dips too, for {where(cpu)}: there the work itself moved; more "
            "`repeats` would tell a lasting effect from noise."
        )
    return text + spread
