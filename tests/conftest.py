"""Shared fixtures: live clusters are slow to start (each rank imports torch), so the suite
keeps one per world size for the whole session; tests that break a cluster make their own."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

# The parity table's models and runs live with the benchmarks (benchmarks/parity_models.py,
# parity_runs.py); the ranks import them by name, and a rank starts with this path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

# Headless everywhere: figures render to files, never to a window.
os.environ.setdefault("MPLBACKEND", "Agg")

# The tools the suite starts by name (nbgrader calls `alembic`, the multi-node test `torchrun`)
# are this interpreter's, whether or not its venv is activated.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

# A suite started in the background (`cmd &`, `nohup`) inherits SIGINT ignored, and so would every
# process it starts: the Ctrl-C tests would wait for an interrupt nobody hears. Here the tests are
# what presses Ctrl-C, so the suite takes it back (its children then start with the default).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
    from fsdp_lab.course import ClusterPool

    with ClusterPool(time_limit=60) as pool:
        yield pool


@pytest.fixture(scope="session")
def fsdp_lab_cli(tmp_path_factory):
    """``fsdp_lab_cli(*args)`` -> (the finished ``python -m fsdp_lab *args`` process, its folder),
    run once per argument list in the session: tests in several files that check the same
    command's output share one run (each run starts its own ranks, which import torch: seconds).
    ``{out}`` in an argument stands for that folder, a fresh one."""
    import subprocess
    import sys

    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}
    runs: dict[tuple[str, ...], tuple[subprocess.CompletedProcess, Path]] = {}

    def run(*args: str) -> tuple[subprocess.CompletedProcess, Path]:
        if args not in runs:
            out = tmp_path_factory.mktemp("fsdp_lab_cli")
            argv = [a.replace("{out}", str(out)) for a in args]
            proc = subprocess.run(
                [sys.executable, "-m", "fsdp_lab", *argv],
                capture_output=True,
                text=True,
                env=env,
                timeout=300,
            )
            runs[args] = (proc, out)
        return runs[args]

    return run


def _set_threads(count: int) -> int:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    return before


@pytest.fixture(scope="session")
def one_thread_per_rank():
    """``with one_thread_per_rank(cluster):`` its ranks compute on one intra-op thread each, then
    on what they had before. For labs whose workers keep torch's default thread count: N ranks x
    that many OpenMP threads on a few cores spin against each other (several times slower, see
    `fsdp_lab.cluster.rank_threads`); values, bytes and model-state memory are the same."""
    import contextlib

    @contextlib.contextmanager
    def on_one_thread(cluster):
        before = cluster.run(_set_threads, 1)
        try:
            yield cluster
        finally:
            cluster.run(_set_threads, before[0])

    return on_one_thread


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
