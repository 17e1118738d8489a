"""When did a rank compute, and when did it talk? A per-rank span timeline.

A `Timeline` is a list of spans `(kind, name, start, end, bytes)` with `kind` either
``"compute"`` or ``"comm"``. `fsdp_lab.comm` records a comm span for every collective it
runs while a timeline is active; mechanisms wrap their compute in `compute_span(...)`. Drawn
as a Gantt chart (`fsdp_lab.plots.plot_timeline`), the timeline shows whether communication
overlaps compute (prefetch) or stalls it — the picture PyTorch's profiler traces give for
FSDP, reduced to what a lesson needs.

The active timeline lives in a `contextvars.ContextVar`, so code deep inside a mechanism can
record into it without a global singleton: ``with Timeline() as tl: ...`` scopes it.
"""

from __future__ import annotations

import contextvars
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

_ACTIVE: contextvars.ContextVar[Timeline | None] = contextvars.ContextVar(
    "fsdp_lab_timeline", default=None
)


@dataclass
class Span:
    kind: str  # "compute" or "comm"
    name: str
    start: float  # seconds, time.perf_counter() minus the timeline's origin
    end: float
    bytes: int = 0
    group: str = ""  # comm: the process group's label (`comm.group_label`)
    tag: str = ""  # comm: what the message was for (a unit's name), from `comm.tagged`


class Recorder:
    """A recorder that is active inside ``with``: code deep in a mechanism finds it through the
    class's context variable (`_active`), and a re-run notebook cell starts a clean scope."""

    _active: contextvars.ContextVar

    def __init__(self) -> None:
        self._origin = time.perf_counter()
        self._token: contextvars.Token | None = None

    def __enter__(self):  # returns the subclass instance
        self._token = self._active.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            self._active.reset(self._token)
            self._token = None


class Timeline(Recorder):
    """Spans of compute and communication on one rank.

    Args:
        rank: the rank this timeline belongs to (stored in the exported dict).
    """

    _active = _ACTIVE

    def __init__(self, rank: int | None = None) -> None:
        super().__init__()
        self.rank = rank
        self.spans: list[Span] = []

    def add(
        self,
        kind: str,
        name: str,
        start: float,
        end: float,
        nbytes: int = 0,
        group: str = "",
        tag: str = "",
    ) -> None:
        """Record a span whose start/end are `perf_counter()` readings."""
        if kind not in ("compute", "comm"):
            raise ValueError(f"span kind {kind!r} is not 'compute' or 'comm'")
        origin = self._origin
        self.spans.append(Span(kind, name, start - origin, end - origin, nbytes, group, tag))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable: ``{"rank", "spans": [{kind, name, start, end, bytes, group,
        tag}, ...], "origin", "host"}``. `origin` is the `perf_counter()` reading the span
        times count from: on Linux a system-wide monotonic clock, so the timelines of ranks on
        one `host` share a clock and can be set on one axis (`waiting_times`)."""
        return {
            "rank": self.rank,
            "spans": [asdict(s) for s in self.spans],
            "origin": self._origin,
            "host": socket.gethostname(),
        }


def common_clock(timelines: list[dict[str, Any]]) -> bool:
    """Whether the ranks' timelines can be set on one time axis: all from one host."""
    hosts = {tl.get("host") for tl in timelines}
    return len(hosts) == 1 and None not in hosts and all("origin" in tl for tl in timelines)


def waiting_times(timelines: list[dict[str, Any]]) -> list[list[float]]:
    """Per rank, per span: seconds of the span spent waiting for other ranks (0 for compute).

    A collective cannot move a byte before every rank of its group has entered it, so the part
    of a comm span before the last member's start is waiting, not transfer. Calls are matched
    across ranks by (group, op, k-th call): every member issues a group's collectives in the
    same order. Ranks on different hosts share no clock: everything counts as transfer then.
    """
    waits = [[0.0] * len(tl["spans"]) for tl in timelines]
    if not common_clock(timelines):
        return waits
    calls: dict[tuple[str, str, int], list[tuple[int, int, float]]] = {}
    for r, tl in enumerate(timelines):
        seen: dict[tuple[str, str], int] = {}
        for i, s in enumerate(tl["spans"]):
            if s["kind"] != "comm":
                continue
            key = (s.get("group", ""), s["name"])
            k = seen[key] = seen.get(key, -1) + 1
            calls.setdefault((*key, k), []).append((r, i, tl["origin"] + s["start"]))
    for members in calls.values():
        last = max(t for _, _, t in members)
        for r, i, t in members:
            span = timelines[r]["spans"][i]
            waits[r][i] = min(last - t, span["end"] - span["start"])
    return waits


def active_timeline() -> Timeline | None:
    """The timeline recording in this context, or None."""
    return _ACTIVE.get()


@contextmanager
def compute_span(name: str) -> Iterator[None]:
    """Record the enclosed block as a compute span on the active timeline (no-op without one)."""
    timeline = _ACTIVE.get()
    if timeline is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        timeline.add("compute", name, start, time.perf_counter())


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in xs for c, d in ys)


def time_shares(timelines: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds per rank, averaged over the ranks: from the first span to the last, computing,
    inside collectives waiting for other ranks, moving bytes, and moving bytes *while* the
    same rank computed (what prefetch hides). What the timeline figure shows, as numbers."""
    waits = waiting_times(timelines)
    totals = dict.fromkeys(("span", "compute", "waiting", "transfer", "hidden"), 0.0)
    for tl, wait in zip(timelines, waits, strict=True):
        spans = tl["spans"]
        if not spans:
            continue
        compute = _union([(s["start"], s["end"]) for s in spans if s["kind"] == "compute"])
        moving = [
            (s["start"] + w, s["end"])
            for s, w in zip(spans, wait, strict=True)
            if s["kind"] == "comm" and s["end"] > s["start"] + w
        ]
        waiting = [(s["start"], s["start"] + w) for s, w in zip(spans, wait, strict=True) if w > 0]
        moving_u = _union(moving)
        totals["span"] += max(s["end"] for s in spans) - min(s["start"] for s in spans)
        totals["compute"] += _length(compute)
        totals["waiting"] += _length(_union(waiting))
        totals["transfer"] += _length(moving_u)
        totals["hidden"] += _overlap(moving_u, compute)
    return {k: v / len(timelines) for k, v in totals.items()}
