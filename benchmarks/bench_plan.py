"""The planner at real size, each plan verified on a fake rank: Llama-3 8B / 70B / 405B on
8 / 64 / 512 GPUs under ZeRO-1/2/3 and HSDP — and what a fake-rank verification costs.

    python benchmarks/bench_plan.py [--models llama3-8b llama3-70b llama3-405b]
        [--gpus 8 64 512] [--strategies zero1 zero2 zero3 hsdp] [--seq 8192]
        [--micro-batch 1] [--checkpoint blocks] [--gpu h100] [--json PATH]

Per row: whether the plan fits an H100 (80 GiB, 10 % kept back), the planned peak per GPU
and the fake rank's, their difference, the bytes per GPU per step (planned; "= fake" when the
fake rank's ledger holds exactly the same), and the fake run's wall time and peak resident
memory — each run in its own fresh process, rank 0 of the world simulated (PyTorch's fake
process group and FakeTensorMode, our `shard()` at full size, two Adam steps).

The goal of issue 30: Llama-3-70B on 64 ranks verified in under 2 minutes and 2 GB of resident
memory on 2 CPU cores; printed as its own line. No assertion: a benchmark reports.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import fsdp_lab
from fsdp_lab.planning.fake_ranks import run_in_subprocess
from fsdp_lab.planning.verify import compare, fake_run

GB = 1e9
GOAL = ("llama3-70b", 64, "zero3", 120.0, 2 * 2**30)  # model, GPUs, strategy, seconds, bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama3-8b", "llama3-70b", "llama3-405b"])
    parser.add_argument("--gpus", nargs="+", type=int, default=[8, 64, 512])
    parser.add_argument("--strategies", nargs="+", default=["zero1", "zero2", "zero3", "hsdp"])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--checkpoint", default="blocks")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--json", help="also write every verified plan here")
    args = parser.parse_args()
    print(
        f"bench_plan: seq {args.seq} x micro-batch {args.micro_batch}, checkpoint "
        f"{args.checkpoint}, bf16-mixed, {args.gpu}; {platform.processor() or platform.machine()}"
        f", {fsdp_lab.__name__} fake ranks",
        flush=True,
    )
    print(
        "\n| model | GPUs | strategy | fits | planned GB/GPU | fake GB/GPU | diff | "
        "GB sent/GPU/step | fake run s | RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for model in args.models:
        for gpus in args.gpus:
            for strategy in args.strategies:
                planned = fsdp_lab.plan(
                    model,
                    gpus=gpus,
                    strategy=strategy,
                    seq=args.seq,
                    gpu=args.gpu,
                    micro_batch=args.micro_batch,
                    checkpoint=args.checkpoint,
                )
                started = time.perf_counter()
                plan = {
                    **planned,
                    "verified": compare(planned, run_in_subprocess(fake_run(planned))),
                }
                rows.append(plan)
                print_row(plan, time.perf_counter() - started)
    for model, gpus, strategy, seconds, rss in (GOAL,):
        goal = [
            p for p in rows if (p["model"], p["gpus"], p["strategy"]) == (model, gpus, strategy)
        ]
        for p in goal:
            v = p["verified"]
            print(
                f"\ngoal: {model} on {gpus} fake ranks ({strategy}) verified in "
                f"{v['wall_s']:.1f} s (goal < {seconds:.0f} s), peak resident "
                f"{v['peak_rss_bytes'] / 2**20:,.0f} MiB (goal < {rss / 2**30:.0f} GiB): "
                f"{'met' if v['wall_s'] < seconds and v['peak_rss_bytes'] < rss else 'NOT met'}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def print_row(plan: dict, seconds: float) -> None:
    v = plan["verified"]
    sent = sum(plan["comm_bytes_per_rank"]["by_collective"].values())
    exact = set(v["comm_bytes_rel_diff"].values()) == {0.0}
    print(
        f"| {plan['model']} | {plan['gpus']} | {plan['strategy']} | "
        f"{'yes' if plan['fits'] else 'no'} | {plan['per_rank_bytes']['total'] / GB:,.1f} | "
        f"{v['per_rank_bytes']['total'] / GB:,.1f} | {v['per_rank_bytes_rel_diff']['total']:+.1%}"
        f" | {sent / GB:,.1f}{' = fake' if exact else ' (fake differs)'} | {seconds:.1f} | "
        f"{v['peak_rss_bytes'] / 2**20:,.0f} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
