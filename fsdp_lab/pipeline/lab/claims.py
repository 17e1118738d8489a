"""Lab 05, the sentences that judge: a course-note claim against what this run measured, and a
time curve against the noise it was measured in. Each is built from the result and says
"holds" or "fails" (or "does not show") as the numbers go; `report` shows them.

- "Exact seeding makes init O(1) in the number of nodes": `scaling_sentence`, from the init
  timed on 1, 2, ... ranks (`timing.scaling_rows`).
- "Same seed on every stage harms convergence": `convergence_sentence`, from the trainings on a
  learnable task (`convergence.compare`).
- A hump in the init-time curve as the model grows: `growth_timing_sentence`, wall time read
  against CPU time (`timing.growth_timing`).
"""

from __future__ import annotations

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.pipeline.lab.convergence import MIN_SEEDS
from fsdp_lab.pipeline.lab.pictures import EXACT_SEEDING, label
from fsdp_lab.pipeline.lab.tables import ms
from fsdp_lab.pipeline.lab.timing import TREND_TOLERANCE
from fsdp_lab.pipeline.lab.words import join, labels, verb

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
        f"{moved} (a move counts only beyond {TREND_TOLERANCE:.0%} and beyond the spread of "
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
    slow = {s: f for s, f in first.items() if f["ratio"] > 1 + TREND_TOLERANCE}
    if not slow:
        return (
            " Each strategy's first call in the rank processes (a warm-up, not kept) took no "
            f"more than {1 + TREND_TOLERANCE:.2f}x its measured median: first calls cost nothing "
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
    tol = f"{TREND_TOLERANCE:.0%}"

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
