"""How many CPU cores this process may use, and what to say when ranks outnumber them.

Kept free of torch: the CLI checks this before it imports anything heavy. `Cluster` warns with
`OversubscribedWarning` (once per place, as Python warnings go); the CLI prints its own line
with the flag to change, and silences the Cluster's.
"""

from __future__ import annotations

import os


class OversubscribedWarning(UserWarning):
    """More ranks than CPU cores: steps slow down and timings measure contention."""


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. under taskset or a cgroup)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def too_many_ranks(world_size: int, cores: int, fix: str) -> str | None:
    """The one-line warning for more ranks than cores (`fix`: what to set instead), or None."""
    if world_size <= cores:
        return None
    return (
        f"{world_size} ranks on {cores} CPU core{'s' if cores > 1 else ''}: the ranks take turns "
        "on the cores, so steps run slower and times measure contention for the cores, not the "
        f"mechanism (bytes and values stay exact); use {fix} or fewer for representative times"
    )
