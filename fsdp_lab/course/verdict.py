"""`Verdict`: what a check says, in a form a learner can act on and a gradebook can store.

Never a bare "assertion failed": a failed verdict names the case (world size, model), what went
wrong in one line, expected vs got as a small table, one sentence of hint, and — when the
learner's code raised or hung — that rank's traceback. It renders as Markdown in a notebook,
as plain text on a terminal, and as a JSON object for `fsdp-lab grade --json`.

Kinds of verdict: "passed"; "wrong result" (the mechanism ran, a measured value is wrong);
"wrong output" (a returned value of the wrong type, shape or dtype); "raised" (an exception on
a rank); "hung" (a rank did not finish within the time limit); "died" (a rank process ended);
"wrong signature"; "not implemented" (the stub is still there); "missing" (a submission
without the function); "no result" (the grading process ended before the case ran: its time
limit, an exit, a crash); "invalid reply" (what came back from the learner's processes is not
what the trial returns: only tampering with the grader produces it).
"""

from __future__ import annotations

import os
import unicodedata
from dataclasses import asdict, dataclass, field
from typing import Any

from fsdp_lab.markdown import table

KINDS = (
    "passed",
    "wrong result",
    "wrong output",
    "raised",
    "hung",
    "died",
    "wrong signature",
    "not implemented",
    "missing",
    "no result",
    "invalid reply",
)


def printable(text: str, keep_newlines: bool = False) -> str:
    """`text` with undecodable bytes as \\xNN, lone surrogates as \\udNNN, and control and
    bidirectional characters escaped, so no name or message can rewrite the line (or the
    terminal) it is printed on, nor stop it being printed or written as UTF-8."""
    # A file name's undecodable bytes arrive as surrogates U+DC80..U+DCFF (surrogateescape):
    # back to their bytes, shown as \xNN; any other surrogate (a message's "\ud800") escaped.
    text = "".join(
        ch
        if not 0xD800 <= ord(ch) <= 0xDFFF or 0xDC80 <= ord(ch) <= 0xDCFF
        else f"\\u{ord(ch):04x}"
        for ch in str(text)
    )
    text = os.fsencode(text).decode("utf-8", errors="backslashreplace")
    return "".join(
        ch
        if unicodedata.category(ch) not in ("Cc", "Cf") or (keep_newlines and ch == "\n")
        else ch.encode("unicode_escape").decode()
        for ch in text
    )


def rows_text(rows: list, indent: str) -> list[str]:
    """A verdict's rows for a terminal: what, expected | got, aligned."""
    if not rows:
        return []
    width = max(len(r[0]) for r in rows)
    head = [f"{indent}{'':{width}}  expected | got"]
    return head + [f"{indent}{what:{width}}  {exp} | {got}" for what, exp, got in rows]


@dataclass(frozen=True)
class Verdict:
    """The outcome of checking one function against one exercise.

    Args:
        exercise: the exercise's name.
        kind: one of `KINDS`.
        summary: one line.
        points: what the exercise is worth; `score` is `points` when passed, else 0.
        case: the label of the case that failed (None when passed or not run).
        passed_cases: labels of the cases passed before it.
        rows: (what, expected, got).
        hint: one sentence.
        rank: the rank the failure is about, if one.
        traceback: that rank's traceback or stack (raised, hung).
        series: curves to draw, expected beside got (see `Mismatch.series`).
    """

    exercise: str
    kind: str
    summary: str
    points: int
    case: str | None = None
    passed_cases: list[str] = field(default_factory=list)
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    hint: str = ""
    rank: int | None = None
    traceback: str = ""
    series: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        return self.kind == "passed"

    @property
    def score(self) -> int:
        return self.points if self.passed else 0

    def headline(self) -> str:
        """One line: ✓/✗, the exercise, the kind, the case."""
        mark = "✓" if self.passed else "✗"
        where = f" — case: {self.case}" if self.case else ""
        rank = f", rank {self.rank}" if self.rank is not None else ""
        return (
            f"{mark} {self.exercise}: {self.kind}{where}{rank} "
            f"({self.score} of {self.points} points)"
        )

    def to_markdown(self) -> str:
        parts = [f"**{self.headline()}**", "", self.summary]
        if self.passed_cases and not self.passed:
            parts += ["", "Passed before it: " + "; ".join(self.passed_cases) + "."]
        if self.rows:
            parts += ["", table(["", "expected", "got"], self.rows)]
        if self.hint:
            parts += ["", f"*Hint:* {self.hint}"]
        if self.traceback:
            parts += ["", "```", self.traceback.rstrip(), "```"]
        return "\n".join(parts)

    def to_text(self) -> str:
        parts = [self.headline(), "  " + self.summary]
        if self.passed_cases and not self.passed:
            parts.append("  passed before it: " + "; ".join(self.passed_cases))
        parts += rows_text(self.rows, "  ")
        if self.hint:
            parts.append("  hint: " + self.hint)
        if self.traceback:
            parts += ["", self.traceback.rstrip()]
        return "\n".join(parts)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["rows"] = [list(r) for r in self.rows]
        out.update(passed=self.passed, score=self.score)
        return out

    def _repr_markdown_(self) -> str:
        return self.to_markdown()

    def __str__(self) -> str:
        return self.to_text()


class ExerciseFailed(AssertionError):
    """Raised by `check_<name>` when the verdict is not "passed" (so nbgrader scores the test
    cell 0). In a notebook it shows as its headline only: the verdict itself was shown above."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.to_text())
        self.verdict = verdict

    def _render_traceback_(self) -> list[str]:  # IPython: instead of a Python traceback
        return [f"ExerciseFailed: {self.verdict.headline()} — the verdict above says why."]
