"""`ClusterPool`: live clusters of the world sizes the checks need, kept between checks.

Starting ranks takes a second or two; a learner who checks an attempt ten times, or `fsdp-lab
grade` checking a class, should not pay it for every case. A pool starts a cluster of each
world size on first use and keeps it, and keeps the reference solution's outcomes of every case
it has measured. A check that hangs or kills a rank costs that cluster its
ranks; `Cluster` starts fresh ones on the next run, so the pool survives for the next attempt.
"""

from __future__ import annotations

import gc
import tempfile
from types import TracebackType

from fsdp_lab.cluster import Cluster, launcher
from fsdp_lab.cluster.driver import check_timeout

DEFAULT_TIME_LIMIT = 30.0  # seconds per case: generous for a laptop CPU, short for a hang
# After the learner's function raised on one rank, the others (waiting in a collective for it)
# are given this long before they are stopped: a check's ranks have nothing slow left to do.
FAILURE_GRACE = 2.0


def _import_exercises() -> None:
    import torch

    import fsdp_lab.course.catalog  # noqa: F401  (every exercise module, and what they use)

    # The first optimizer a process builds imports torch._dynamo (seconds): do it untimed.
    w = torch.zeros(1, requires_grad=True)
    torch.optim.SGD([w], lr=0.1).step()
    # What is alive now lives as long as the rank: out of the collector's sight, a collection
    # (`exercise.release_groups`, after a trial made groups) scans a trial's objects only —
    # milliseconds, not the 85 ms of walking torch's modules every time.
    gc.freeze()


class ClusterPool:
    """Clusters by world size, for checks (gloo on CPU; a check never measures time).

    Args:
        time_limit: seconds one case may take on the ranks before they count as hung.
        backend: passed to `Cluster`.
        device: passed to `Cluster` (None: its default; the grader pins "cpu", where the
            sandboxed submissions run).
    """

    def __init__(
        self,
        time_limit: float = DEFAULT_TIME_LIMIT,
        backend: str = "gloo",
        device: str | None = None,
    ) -> None:
        self.time_limit = check_timeout("time_limit", time_limit)
        # Every rank of a check imports every exercise and takes an optimizer step: done once in
        # the fork server the ranks come from, when the pool is the first to start ranks.
        launcher.preload("fsdp_lab.course.catalog")
        self.backend, self.device = backend, device
        self._clusters: dict[int, Cluster] = {}
        # (exercise, case label) -> the reference solution's per-rank outcomes: the reference
        # gives the same values every time, so a pool measures each case once.
        self.expected: dict[tuple[str, str], list] = {}
        self._folder = tempfile.TemporaryDirectory(prefix="fsdp_lab_check_")
        self.stack_dir = self._folder.name

    def cluster(self, world_size: int) -> Cluster:
        """The pool's cluster of `world_size` ranks, started on first use."""
        if world_size not in self._clusters:
            self._clusters[world_size] = Cluster(
                world_size,
                backend=self.backend,
                device=self.device,
                timeout=self.time_limit,
                verbose=False,
                failure_grace=FAILURE_GRACE,
                plain_results=True,  # a trial returns JSON text: nothing else is read
                timed=False,  # checks compare values, never times: 3 ranks on 2 cores are fine
            )
            self._warm_up(self._clusters[world_size])
        return self._clusters[world_size]

    @staticmethod
    def _warm_up(cluster: Cluster) -> None:
        """Import the exercises on the ranks before any case is timed: on a busy laptop the
        imports alone can take longer than a case may, and would look like a hang."""
        limit, cluster.timeout = cluster.timeout, cluster.start_timeout
        try:
            cluster.run(_import_exercises)
        finally:
            cluster.timeout = limit

    @property
    def pids(self) -> list[int]:
        """Every rank process the pool holds now (for tests that check none is left)."""
        return [pid for c in self._clusters.values() for pid in c.pids]

    def close(self) -> None:
        for c in self._clusters.values():
            c.close()
        self._clusters.clear()
        self._folder.cleanup()

    def __enter__(self) -> ClusterPool:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
