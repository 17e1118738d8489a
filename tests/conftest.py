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
