"""Cluster start-up and per-call latency: how long a notebook waits for its ranks.

    python benchmarks/bench_cluster.py [--world-size 4] [--starts 3] [--calls 50]

Prints medians of:
- cold start: a fresh Python process runs ``from fsdp_lab import Cluster`` (which starts the
  fork server importing torch in the background) and then ``Cluster(N)``; the time of the
  ``Cluster(N)`` line alone (what the learner waits for in the cell after the import), and
  of the whole process from its first line to ranks up (the import of torch included);
- warm start: another ``Cluster(N)`` in the same process (the fork server is running);
- restart after a failure: a rank killed, the next ``run()`` reports it, the one after starts
  fresh ranks and runs (the figure is that last ``run()``);
- warm ``run()`` of a trivial function (ship by cloudpickle, run, reply).

No assertion: a benchmark reports, tests assert behaviour.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import psutil

COLD = """
import json, sys, time
t0 = time.perf_counter()
from fsdp_lab import Cluster
t1 = time.perf_counter()
with Cluster(int(sys.argv[1]), verbose=False) as cluster:
    t2 = time.perf_counter()
print(json.dumps({"cluster": t2 - t1, "process": t2 - t0}))
"""


def cold_start(world_size: int) -> dict[str, float]:
    """Cluster(N) in a fresh interpreter; its own clock, so interpreter start-up is left out."""
    out = subprocess.run(
        [sys.executable, "-c", COLD, str(world_size)], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    n = args.world_size

    from fsdp_lab import Cluster, RankError, rank

    cold = [cold_start(n) for _ in range(args.starts)]
    print(
        f"cold start, Cluster({n}) after the import: median "
        f"{statistics.median(c['cluster'] for c in cold):.2f} s; fresh process to ranks up "
        f"(torch imported): median {statistics.median(c['process'] for c in cold):.2f} s",
        flush=True,
    )

    Cluster(1, verbose=False).close()  # the fork server is up and has imported torch
    warm_start, restart, calls = [], [], []
    for _ in range(args.starts):
        t0 = time.perf_counter()
        with Cluster(n, verbose=False) as cluster:
            warm_start.append(time.perf_counter() - t0)
            cluster.run(rank)  # the first call also unpickles fsdp_lab on every rank
            for _ in range(args.calls):
                t0 = time.perf_counter()
                cluster.run(rank)
                calls.append(time.perf_counter() - t0)
            victim = cluster.pids[-1]
            os.kill(victim, signal.SIGKILL)
            psutil.Process(victim).wait(10)
            with contextlib.suppress(RankError):  # reported: the next run() starts fresh ranks
                cluster.run(rank)
            t0 = time.perf_counter()
            cluster.run(rank)
            restart.append(time.perf_counter() - t0)
    print(f"world size {n} on {cluster.backend}, {os.cpu_count()} CPU core(s)")
    print(f"warm start   median {statistics.median(warm_start):.3f} s (fork server running)")
    print(f"restart      median {statistics.median(restart):.3f} s (fresh ranks + the call)")
    print(
        f"warm run()   median {statistics.median(calls) * 1e3:.2f} ms "
        f"(p90 {sorted(calls)[int(0.9 * len(calls))] * 1e3:.2f} ms, {len(calls)} calls)"
    )


if __name__ == "__main__":
    main()
