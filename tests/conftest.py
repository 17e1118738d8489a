"""Shared fixtures: live clusters are slow to start (each rank imports torch), so the suite
keeps one per world size for the whole session; tests that break a cluster make their own."""

from __future__ import annotations

import os

import pytest

# Headless everywhere: figures render to files, never to a window.
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(scope="session")
def cluster_of():
    """``cluster_of(n)`` -> a live gloo `Cluster` of n ranks, shared by the session."""
    from fsdp_lab import Cluster

    clusters: dict[int, Cluster] = {}

    def get(n: int) -> Cluster:
        if n not in clusters:
            clusters[n] = Cluster(n, backend="gloo", timeout=600, verbose=False)
        return clusters[n]

    yield get
    for c in clusters.values():
        c.close()


@pytest.fixture(scope="session")
def exercise_pool():
    """One `exercises.ClusterPool` for every checker test: its clusters (2, 3, 4 ranks) start
    once. A test that makes a check hang or die costs that cluster its ranks; the pool starts
    fresh ones on the next check, as it does for a learner."""
    from fsdp_lab.exercises import ClusterPool

    with ClusterPool(time_limit=60) as pool:
        yield pool


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Print how long each notebook took top to bottom (tests/test_notebooks.py records it):
    the issue's budget is under 60 s each on 2 idle cores."""
    times: dict[str, float] = {}  # every phase's report carries the property: keep one
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", []):
                if key == "notebook_seconds":
                    times[value[0]] = value[1]
    if times:
        terminalreporter.write_sep("-", "notebook run times (top to bottom)")
        for name, seconds in sorted(times.items()):
            terminalreporter.write_line(f"{name}: {seconds:.0f} s")
