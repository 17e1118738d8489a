"""Our FSDP (`fsdp_lab.shard`, ZeRO-3) beside FSDP2's `fully_shard` and the plain model, on a GPU.

    python benchmarks/bench_gpu.py [--world-sizes 1 2 4] [--steps 8] [--repeats 3]
        [--dim 768 --layers 12 --heads 12 --vocab 32768 --seq 1024 --batch 8]
        [--device auto|cuda|cpu] [--profile] [--json PATH]

The defaults are the 111M-parameter TinyGPT of issue 29: bf16 compute with fp32 gradient
reduction, Adam. At 1 rank one GPU per rank (NCCL); at 2 and 4 the ranks share the GPU (gloo
on CUDA tensors, `Cluster(n, device="cuda")`). Systems (`bench_ops.build`), the same model,
seed and data, `--batch` sequences per rank:

    plain         the model alone under torch.autocast(bf16), fp32 weights (1 rank only: with
                  several ranks it would not be one training run)
    ours          fsdp_lab.shard(model, units={Block}, strategy="full",
                                 mixed_precision=MixedPrecision(bfloat16, float32))
    ours+offload  the same with offload=True: every shard in (pinned) host memory
    fully_shard   fully_shard on every Block and the root, MixedPrecisionPolicy(bfloat16, float32)

Repeats are interleaved (plain, ours, ..., plain, ...). A step is timed between
`torch.cuda.synchronize()` calls on every rank, the slowest rank counts, the median over the
steps after the first two (lazy init, optimizer state), then the median over repeats. Peak
memory: `torch.cuda.max_memory_allocated` over the run, the highest rank. At 1 rank also the
operators per step (`bench_ops.count_ops`) and, with `--profile`, PyTorch's profiler over 3
steps of plain, ours and ours+offload: the operators by device time — where ours' time over the
plain model goes — and offload's host<->device copies (CUDA time per step). On a machine
without a GPU, `--device cpu` runs the same code on CPU ranks (no peak memory; for trying it).

No assertion: a benchmark reports, tests assert behaviour. The goals are printed, met or not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

import bench_ops
import cloudpickle
import torch
from bench_ops import WARMUP, batches, build, count_ops, timed, train_step

from fsdp_lab import Cluster

cloudpickle.register_pickle_by_value(bench_ops)  # the ranks have no benchmarks/ on their path

SYSTEMS = ("plain", "ours", "ours+offload", "fully_shard")
PROFILED = ("plain", "ours", "ours+offload")
PROFILED_STEPS = 3
MiB = 2**20


def on_rank(system: str, cfg: dict[str, Any], profile: bool = False) -> dict[str, Any]:
    """Build `system`, train `cfg["steps"]` steps; per-step times, peak memory (or a profile)."""
    import torch.distributed as dist

    from fsdp_lab.cluster.where import device as placed_device

    device = placed_device()
    cuda = device.type == "cuda"
    if not cuda:  # CPU ranks share the cores, as bench_ops' do
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    model, optimizer = build(system, cfg, "bf16", device)
    world = {**cfg, "batch": cfg["batch"] * dist.get_world_size()}  # `--batch` per rank
    steps = batches(world, cfg["steps"], device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    if profile:
        return _profile(model, optimizer, steps, cuda)
    return {
        "step_s": timed(model, optimizer, steps),
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
    }


def _profile(model: Any, optimizer: Any, steps: list, cuda: bool) -> dict[str, Any]:
    """The profiler's table over `PROFILED_STEPS` steps, and the host<->device copies' device
    time per step (CPU offload's traffic; none for the others)."""
    from torch.profiler import ProfilerActivity, profile

    for batch in steps[:WARMUP]:
        train_step(model, optimizer, batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for batch in steps[WARMUP : WARMUP + PROFILED_STEPS]:
            train_step(model, optimizer, batch)
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    copies = {"HtoD": 0.0, "DtoH": 0.0}
    for event in events:
        for way in copies:
            if event.key.startswith(f"Memcpy {way}"):
                copies[way] += event.device_time_total / 1e3 / PROFILED_STEPS  # us -> ms
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    return {"table": events.table(sort_by=sort, row_limit=25), "copy_ms_per_step": copies}


def measure(n: int, args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    systems = SYSTEMS if n == 1 else SYSTEMS[1:]
    times: dict[str, list[float]] = {s: [] for s in systems}
    peaks: dict[str, int | None] = {}
    with Cluster(n, device=args.device, verbose=True) as cluster:
        ops = (
            {s: cluster.run(count_ops, s, cfg, "bf16")[0]["total"] for s in systems}
            if n == 1
            else {}
        )
        for repeat in range(args.repeats):
            for system in systems:
                per_rank = cluster.run(on_rank, system, cfg)
                slowest = [max(t) for t in zip(*(r["step_s"] for r in per_rank), strict=True)]
                times[system].append(statistics.median(slowest[WARMUP:] or slowest))
                rank_peaks = [r["peak_bytes"] for r in per_rank]
                peaks[system] = None if None in rank_peaks else max(rank_peaks)
            print(f"  {n} rank(s), repeat {repeat + 1}/{args.repeats} done", flush=True)
        profiles = (
            {s: cluster.run(on_rank, s, cfg, True)[0] for s in PROFILED}
            if args.profile and n == 1
            else {}
        )
    return {
        "step_s": {s: statistics.median(t) for s, t in times.items()},
        "step_s_repeats": times,
        "peak_bytes": peaks,
        "ops_per_step": ops,
        "profiles": profiles,
    }


def print_table(n: int, measured: dict[str, Any]) -> None:
    step, peak, ops = measured["step_s"], measured["peak_bytes"], measured["ops_per_step"]
    print(f"\n{n} rank(s): median step over {len(measured['step_s_repeats']['ours'])} repeat(s)")
    print("| system | ms/step | / plain | / fully_shard | peak MiB | operators per step |")
    print("|---|---|---|---|---|---|")
    for system, seconds in step.items():
        vs_plain = f"{seconds / step['plain']:.2f}" if "plain" in step else "-"
        mib = f"{peak[system] / MiB:,.0f}" if peak[system] is not None else "-"
        print(
            f"| {system} | {seconds * 1e3:.1f} | {vs_plain} | {seconds / step['fully_shard']:.2f} "
            f"| {mib} | {ops.get(system, '-')} |"
        )
    if peak["ours"] is not None:
        saved = (peak["ours"] - peak["ours+offload"]) / MiB
        print(f"offload: device memory saved at the peak {saved:,.0f} MiB (ours - ours+offload)")
    for system, profiled in measured["profiles"].items():
        copies = ", ".join(f"{k} {v:.2f} ms" for k, v in profiled["copy_ms_per_step"].items())
        print(f"\nprofile, {system}, 1 rank, {PROFILED_STEPS} steps; copies per step: {copies}")
        print(profiled["table"])


def print_goals(results: dict[int, dict[str, Any]]) -> None:
    """The issue's goals on the table's own medians, met or not."""
    if 1 in results:
        step = results[1]["step_s"]
        ratio = step["ours"] / step["plain"]
        print(f"ours / plain at 1 rank ≤ 1.10: {ratio:.2f} {'met' if ratio <= 1.10 else 'not met'}")
    fsdp2 = ", ".join(
        f"{n}: {r['step_s']['ours'] / r['step_s']['fully_shard']:.2f}"
        + (" met" if r["step_s"]["ours"] <= r["step_s"]["fully_shard"] else " not met")
        for n, r in results.items()
    )
    print(f"ours / fully_shard ≤ 1.00 by ranks: {fsdp2}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    for name, default in (
        ("dim", 768),
        ("layers", 12),
        ("heads", 12),
        ("vocab", 32768),
        ("seq", 1024),
        ("batch", 8),
    ):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", help="also write the medians here")
    args = parser.parse_args()
    bench_ops.check_args(parser, args)
    if args.steps < WARMUP + PROFILED_STEPS:
        parser.error(f"--steps {args.steps}: expected at least {WARMUP + PROFILED_STEPS}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU visible here. Fix: --device cpu to try it on the CPU")
    cfg = {
        k: getattr(args, k) for k in ("dim", "layers", "heads", "vocab", "seq", "batch", "steps")
    }
    print(f"bench_gpu: {cfg}, device {args.device}, torch {torch.__version__}", flush=True)
    results = {}
    for n in args.world_sizes:
        results[n] = measure(n, args, cfg)
        print_table(n, results[n])
    print()
    print_goals(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "device": args.device, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
