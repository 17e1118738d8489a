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

    def add(self, kind: str, name: str, start: float, end: float, nbytes: int = 0) -> None:
        """Record a span whose start/end are `perf_counter()` readings."""
        if kind not in ("compute", "comm"):
            raise ValueError(f"span kind {kind!r} is not 'compute' or 'comm'")
        self.spans.append(Span(kind, name, start - self._origin, end - self._origin, nbytes))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable: ``{"rank": r, "spans": [{kind, name, start, end, bytes}, ...]}``."""
        return {"rank": self.rank, "spans": [asdict(s) for s in self.spans]}


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
