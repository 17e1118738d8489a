"""Cluster start-up and per-call latency: how long a notebook waits for its ranks.

    python benchmarks/bench_cluster.py [--world-size 4] [--starts 3] [--calls 50]

Prints the median cold start (spawn N processes, import torch in each, join the process
group) and the median warm `run` of a trivial function (ship by cloudpickle, run, reply).
No assertion: a benchmark reports, tests assert behaviour.
"""

from __future__ import annotations

import argparse
import statistics
import time

from fsdp_lab import Cluster, rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()

    cold, warm = [], []
    for i in range(args.starts):
        t0 = time.perf_counter()
        with Cluster(args.world_size, verbose=False) as cluster:
            cold.append(time.perf_counter() - t0)
            cluster.run(rank)  # the first call also unpickles fsdp_lab on every rank
            for _ in range(args.calls):
                t0 = time.perf_counter()
                cluster.run(rank)
                warm.append(time.perf_counter() - t0)
        print(f"start {i + 1}/{args.starts}: cold {cold[-1]:.2f} s", flush=True)
    print(f"world size {args.world_size} on {cluster.backend}")
    print(f"cold start   median {statistics.median(cold):.2f} s   (min {min(cold):.2f} s)")
    print(
        f"warm run()   median {statistics.median(warm) * 1e3:.2f} ms "
        f"(p90 {sorted(warm)[int(0.9 * len(warm))] * 1e3:.2f} ms, {len(warm)} calls)"
    )


if __name__ == "__main__":
    main()
