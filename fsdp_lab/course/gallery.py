"""The bug gallery: classic bugs switched on in the reference mechanisms, each beside the
correct run, with the symptom the lab measures.

Every bug is a wrong version of one exercise's step (`Bug.wrong`). Switching it on means running
the lab's real mechanism with that step in place of the right one — exactly what a check does
with a learner's function — so the symptom shown is measured in this run: the expected column
is the correct run, the got column the buggy one, on the first case where they part. A bug the
checks cannot tell from the correct run would be listed as "not caught" (the tests make sure
none is).

    exhibits = gallery.run(pool)            # every lab's bugs; run(pool, labs=["shard"])
    gallery.show(exhibits)                  # in a notebook: Markdown + curves per bug
    fsdp-lab bugs [--lab L] [--json]        # the same, headless
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fsdp_lab.course.catalog import LABS
from fsdp_lab.course.checker import display_figure, grade
from fsdp_lab.course.pool import ClusterPool
from fsdp_lab.course.verdict import Verdict
from fsdp_lab.exercise import Bug, Exercise
from fsdp_lab.markdown import table


@dataclass(frozen=True)
class Exhibit:
    """One bug, measured: the correct run's verdict and the buggy run's."""

    lab: str
    exercise: str
    bug: Bug
    correct: Verdict
    buggy: Verdict

    @property
    def caught(self) -> bool:
        return self.correct.passed and not self.buggy.passed

    def to_dict(self) -> dict[str, Any]:
        return {
            "lab": self.lab,
            "exercise": self.exercise,
            "bug": self.bug.slug,
            "title": self.bug.title,
            "symptom": self.bug.symptom,
            "caught": self.caught,
            "correct": self.correct.to_dict(),
            "buggy": self.buggy.to_dict(),
        }


def check_labs(labs: Iterable[str] | None) -> list[str]:
    """The labs asked for, in course order; a ValueError naming the ones there are."""
    with_bugs = [lab for lab, group in LABS.items() if any(e.bugs for e in group)]
    if labs is None:
        return with_bugs
    labs = list(labs)
    unknown = [lab for lab in labs if lab not in with_bugs]
    if unknown:
        close = difflib.get_close_matches(unknown[0], with_bugs, n=1)
        fix = f"did you mean {close[0]!r}?" if close else "expected one of " + ", ".join(with_bugs)
        raise ValueError(f"lab {unknown[0]!r} has no bugs in the gallery: {fix}")
    return [lab for lab in with_bugs if lab in labs]


def run(
    pool: ClusterPool,
    labs: Iterable[str] | None = None,
    progress: Callable[[str], None] = print,
) -> list[Exhibit]:
    """Every bug of `labs` (default: all), each run beside its exercise's correct run."""
    exhibits = []
    for lab in check_labs(labs):
        for ex in LABS[lab]:
            if not ex.bugs:
                continue
            correct = grade(ex, ex.solution, pool)
            for bug in ex.bugs:
                progress(f"{lab}: {bug.title} ({ex.name})")
                exhibits.append(Exhibit(lab, ex.name, bug, correct, grade(ex, bug.wrong, pool)))
    return exhibits


def measured(e: Exhibit) -> str:
    """What the check measured on the bug, said of the bug: a verdict speaks to a learner
    ("your segments take more memory"), and in the gallery nothing is a learner's."""
    text = re.sub(r"\byours\b", "the bug's", e.buggy.summary)
    return re.sub(r"\b([Yy])our\b", lambda m: "The" if m[1] == "Y" else "the", text)


def summary_table(exhibits: list[Exhibit]) -> str:
    """Markdown: one row per bug — where it shows and what was measured."""
    rows = [
        (
            e.lab,
            e.bug.title,
            f"`{e.exercise}`",
            e.buggy.case or "—",
            measured(e) if e.caught else "**not caught** by the check",
        )
        for e in exhibits
    ]
    return table(["lab", "bug", "step", "first case where it shows", "measured"], rows)


def silent_sentence(exhibits: list[Exhibit]) -> str:
    """Markdown: how many of the bugs raised nothing — the run finished and only the comparison
    with the correct run shows them — built from this run's verdicts."""
    silent = [e for e in exhibits if e.buggy.kind == "wrong result"]
    loud = [e for e in exhibits if e.caught and e.buggy.kind != "wrong result"]
    text = (
        f"**{len(silent)} of the {len(exhibits)} bugs raised no error at all**: the buggy run "
        "finished like the correct one, and only the comparison with it (the measured columns "
        "above) shows the bug."
    )
    if loud:
        kinds = ", ".join(sorted({f"{e.bug.title} ({e.buggy.kind})" for e in loud}))
        text += f" The others stopped on their own: {kinds}."
    return text


def exhibit_markdown(e: Exhibit, exercise: Exercise | None = None) -> str:
    """One bug: what it is, what the lab measures with it on (beside the correct run), the fix."""
    b = e.buggy
    if not e.caught:
        return f"### {e.bug.title} — not caught\n\n{b.to_markdown()}"
    correct = f"the correct run passes all {len(e.correct.passed_cases)} cases"
    parts = [
        f"### {e.bug.title}",
        f"*Step:* `{e.exercise}` ({e.lab} lab). *What courses see:* {e.bug.symptom}.",
        f"*Measured here, on the case “{b.case}”* ({correct}): {measured(e)}",
    ]
    if b.rows:
        parts.append(table(["", "correct run", "with the bug"], [list(r) for r in b.rows]))
    if b.traceback:
        parts.append("```\n" + b.traceback.rstrip() + "\n```")
    if b.hint:
        parts.append(f"*The fix:* {b.hint}")
    return "\n\n".join(parts)


def figure(e: Exhibit) -> Any:
    """The exhibit's curves (correct run solid, the bug dashed), or None if it has none."""
    series = e.buggy.series
    if series is None:
        return None
    from fsdp_lab.plots import plot_expected_got

    # In the gallery nothing is the learner's: "reference" is the correct run, "yours" the bug.
    lines = {
        name.replace("reference", "correct run").replace("yours", "with the bug"): values
        for name, values in series["lines"].items()
    }
    return plot_expected_got(
        {**series, "lines": lines, "title": f"{e.bug.title}: " + series.get("title", "")}
    )


def show(exhibits: list[Exhibit], lab: str | None = None) -> None:
    """In a notebook: each exhibit of `lab` (default all) as Markdown, then its curves."""
    from IPython.display import Markdown, display

    for e in exhibits:
        if lab is None or e.lab == lab:
            display(Markdown(exhibit_markdown(e)))
            fig = figure(e)
            if fig is not None:
                display_figure(fig)


def tally(exhibits: list[Exhibit]) -> str:
    """One line: how many bugs, how many the checks caught, how many raised no error."""
    caught = sum(e.caught for e in exhibits)
    silent = sum(e.buggy.kind == "wrong result" for e in exhibits)
    labs = len({e.lab for e in exhibits})
    return (
        f"{len(exhibits)} bugs in {labs} lab{'s' if labs != 1 else ''}: {caught} caught by the "
        f"checks, {len(exhibits) - caught} not; {silent} of them raised no error at all (only the "
        "comparison with the correct run shows them)."
    )


def text_report(exhibits: list[Exhibit], detail: bool = False) -> str:
    """For a terminal: one line per bug (what was measured), then the tally; with `detail` (one
    lab asked for), a block per bug: its case, the measured rows beside the correct run's, the
    fix."""
    lines = []
    for e in exhibits:
        b = e.buggy
        state = "caught" if e.caught else "NOT CAUGHT"
        if not detail:
            lines.append(f"{e.lab}: {e.bug.title} [{e.exercise}] — {state}: {measured(e)}")
            continue
        lines.append(f"{e.lab}: {e.bug.title} [{e.exercise}] — {state}, case: {b.case}")
        lines.append(f"  measured: {measured(e)}")
        for what, exp, got in b.rows:  # a row for scale only (store-all) has no bug's value
            lines.append(
                f"  {what}: correct {exp} | with the bug {got}" if got else f"  {what}: {exp}"
            )
        if b.hint:
            lines.append(f"  fix: {b.hint}")
    lines += ["", tally(exhibits)]
    if not detail:
        lines.append("each bug's measured rows and fix: fsdp-lab bugs --lab LAB")
    return "\n".join(lines)
