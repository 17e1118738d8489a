"""Our FSDP (`fsdp_lab.shard`, ZeRO-3) beside FSDP2's `fully_shard` and the plain model, on a GPU.

    python benchmarks/bench_gpu.py [--world-sizes 1 2 4] [--steps 8] [--repeats 3]
        [--dim 768 --layers 12 --heads 12 --vocab 32768 --seq 1024 --batch 8]
        [--device auto|cuda|cpu] [--profile] [--json PATH]

The defaults are the 111M-parameter TinyGPT of issue 29: bf16 compute with fp32 gradient
reduction, Adam. At 1 rank one GPU per rank (NCCL); at 2 and 4 the ranks share the GPU (gloo
on CUDA tensors, `Cluster(n, device="cuda")`). Systems, the same model, seed and data:

    plain   the model alone under torch.autocast(bf16), fp32 weights (1 rank only: with
            several ranks it would not be one training run)
    ours    fsdp_lab.shard(model, units={Block}, strategy="full",
                           mixed_precision=MixedPrecision(bfloat16, float32))
    fsdp2   fully_shard on every Block and the root, MixedPrecisionPolicy(bfloat16, float32)

Repeats are interleaved (plain, ours, fsdp2, plain, ...). A step is timed between
`torch.cuda.synchronize()` calls on every rank, the slowest rank counts, the median over the
steps after the first two (lazy init, optimizer state), then the median over repeats. Peak
memory: `torch.cuda.max_memory_allocated` over the run, the highest rank. `--profile` adds
PyTorch's profiler over 3 steps of plain and ours at 1 rank: the operators ours adds, by
self time — where the time over the plain model goes. On a machine without a GPU,
`--device cpu` runs the same code on CPU ranks (no peak memory; for trying it).

No assertion: a benchmark reports, tests assert behaviour.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from fsdp_lab import Cluster

WARMUP = 2  # steps left out of each run's median
MiB = 2**20


def on_rank(system: str, cfg: dict[str, Any], profile: bool = False) -> dict[str, Any]:
    """Build `system`, train `cfg["steps"]` steps; per-step times, peak memory (or a profile)."""
    import torch.distributed as dist
    from torch import nn

    from fsdp_lab import MixedPrecision, reference
    from fsdp_lab.cluster.where import device as placed_device
    from fsdp_lab.models import Block, GPTConfig, TinyGPT

    device = placed_device()
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    shape = GPTConfig(cfg["vocab"], cfg["seq"], cfg["dim"], cfg["layers"], cfg["heads"])
    model: nn.Module = TinyGPT(shape)
    if system == "plain":
        model = _Autocast(model.to(device), device.type)
    elif system == "ours":
        precision = MixedPrecision(torch.bfloat16, torch.float32)
        model = reference.wrap(model, "ours:full", (Block,), mixed_precision=precision)
    else:  # the same policy, FSDP2's own
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = reference.wrap(model.to(device), "fully_shard", (Block,), mp_policy=policy)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    batch = dict(
        global_batch=cfg["batch"] * dist.get_world_size(),
        seq_len=cfg["seq"],
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        device=device,
        vocab_size=cfg["vocab"],
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        reference.train_steps(model, optimizer, WARMUP, **batch)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profiler(activities=activities) as prof:
            reference.train_steps(model, optimizer, 3, **batch)
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        return {"table": prof.key_averages().table(sort_by=sort, row_limit=25)}
    stamps: list[float] = []

    def stamp(_step: int) -> None:
        if cuda:
            torch.cuda.synchronize(device)
        stamps.append(time.perf_counter())

    dist.barrier()
    stamp(-1)
    reference.train_steps(model, optimizer, cfg["steps"], on_step=stamp, **batch)
    return {
        "step_s": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
    }


class _Autocast(torch.nn.Module):
    """The plain model's mixed precision: fp32 weights, bf16 compute (torch.autocast)."""

    def __init__(self, inner: torch.nn.Module, device_type: str) -> None:
        super().__init__()
        self.inner, self.device_type = inner, device_type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.inner(x)


def measure(n: int, args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    systems = ("plain", "ours", "fsdp2") if n == 1 else ("ours", "fsdp2")
    times: dict[str, list[float]] = {s: [] for s in systems}
    peaks: dict[str, int | None] = {}
    with Cluster(n, device=args.device, verbose=True) as cluster:
        for repeat in range(args.repeats):
            for system in systems:
                per_rank = cluster.run(on_rank, system, cfg)
                slowest = [max(t) for t in zip(*(r["step_s"] for r in per_rank), strict=True)]
                times[system].append(statistics.median(slowest[WARMUP:] or slowest))
                rank_peaks = [r["peak_bytes"] for r in per_rank]
                peaks[system] = None if None in rank_peaks else max(rank_peaks)
            print(f"  {n} rank(s), repeat {repeat + 1}/{args.repeats} done", flush=True)
        profiles = (
            {s: cluster.run(on_rank, s, cfg, True)[0]["table"] for s in ("plain", "ours")}
            if args.profile and n == 1
            else {}
        )
    return {
        "step_s": {s: statistics.median(t) for s, t in times.items()},
        "step_s_repeats": times,
        "peak_bytes": peaks,
        "profiles": profiles,
    }


def print_table(n: int, measured: dict[str, Any]) -> None:
    step, peak = measured["step_s"], measured["peak_bytes"]
    print(f"\n{n} rank(s): median step over {len(measured['step_s_repeats']['ours'])} repeat(s)")
    print("| system | ms/step | / plain | / fsdp2 | peak MiB |")
    print("|---|---|---|---|---|")
    for system, seconds in step.items():
        vs_plain = f"{seconds / step['plain']:.2f}" if "plain" in step else "-"
        mib = f"{peak[system] / MiB:,.0f}" if peak[system] is not None else "-"
        print(
            f"| {system} | {seconds * 1e3:.1f} | {vs_plain} | {seconds / step['fsdp2']:.2f} "
            f"| {mib} |"
        )
    for system, table in measured["profiles"].items():
        print(f"\nprofile, {system}, 1 rank, 3 steps (self time):\n{table}")


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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "device": args.device, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
