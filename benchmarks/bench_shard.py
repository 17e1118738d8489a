"""Our FSDP/ZeRO (`fsdp_lab.shard`, every strategy) next to PyTorch's FSDP2, FSDP1 and DDP.

    python benchmarks/bench_shard.py [--world-sizes 2 4] [--steps 8] [--repeats 3]
        [--dim 128 --layers 4 --vocab 1024 --seq 64 --batch 8] [--json PATH]

Every system trains the same TinyGPT (tied embedding/head, the same seed on every rank) on the
same data (`reference.train_steps`, the global batch split over the ranks), fp32 with Adam:

    ours:full       fsdp_lab.shard(model, units={Block}, strategy="full")        ZeRO-3
    ours:grad_op    ... strategy="grad_op"                                        ZeRO-2
    ours:optimizer  ... strategy="optimizer"                                      ZeRO-1
    ours:none       fsdp_lab.shard(model, strategy="none"): DDP's buckets (25 MiB), overlapped
    fully_shard     fully_shard on every Block, then on the root, at FSDP2's defaults
    fsdp1           FullyShardedDataParallel, Block auto-wrap, use_orig_params=True
    ddp             DistributedDataParallel at its defaults

each wrapped by `fsdp_lab.reference.wrap`, the one table of systems every comparison uses.

One `Cluster` per world size. Step time: `--repeats` timed runs per system, interleaved
(ours:full, ..., ddp, ours:full, ...) so machine noise hits all alike; per step the slowest
rank's time, the median over the steps after the first (lazy init, optimizer state), then the
median over repeats. Ratios are taken repeat by repeat (each against the same repeat's
reference, run moments apart) and quoted as their median with their min-max spread; the load
average is printed with every repeat. Timed runs carry no instrumentation: a tracker's dispatch mode costs
every operator.

Peak memory: one more run per system under `MemoryTracker`, started before the model is
built; the highest rank's peak. The tracker sees `UntypedStorage.resize_` (how FSDP1, FSDP2
and ours free and re-allocate gathered parameters) only at its next `mark()`: ours marks after
each of its resizes, PyTorch's wrappers never do. So the table's tracker is also marked after
every `resize_`, for all four alike. Printed beside it: a tracker marked only as in the shard
lab, and the CPU allocator's bytes counted by PyTorch's profiler over the first two steps.

No assertion: a benchmark reports, tests assert behaviour.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fsdp_lab import Cluster

OURS = ("ours:full", "ours:grad_op", "ours:optimizer", "ours:none")
SYSTEMS = (*OURS, "fully_shard", "fsdp1", "ddp")
PROFILED_STEPS = 2  # the allocator cross-check covers the build and these first steps
MiB = 2**20


# -- on every rank ---------------------------------------------------------------------------


def _build(system: str, s: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same model on every rank and for every system, wrapped by `system`, with Adam."""
    from fsdp_lab import reference
    from fsdp_lab.models import Block, GPTConfig, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(s["vocab"], s["seq"], s["dim"], s["layers"], s["heads"]))
    model = reference.wrap(model, system, () if system in reference.ONE_UNIT else (Block,))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    s: dict[str, Any],
    after_step: Callable[[int], Any] | None = None,
) -> dict[str, list[float]]:
    """`reference.train_steps` from a common start; this rank's step times and losses."""
    import torch.distributed as dist

    from fsdp_lab import reference

    def on_step(step: int) -> None:
        stamps.append(time.perf_counter())
        if after_step is not None:
            after_step(step)

    dist.barrier()  # every rank starts step 0 together
    stamps = [time.perf_counter()]
    losses = reference.train_steps(
        model,
        opt,
        s["steps"],
        global_batch=s["batch"],
        seq_len=s["seq"],
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        on_step=on_step,
    )
    return {"step_s": [b - a for a, b in zip(stamps, stamps[1:], strict=False)], "losses": losses}


def timed_run(system: str, s: dict[str, Any]) -> dict[str, list[float]]:
    """One run of `steps` steps without instrumentation."""
    torch.set_num_threads(s["threads"])
    gc.collect()
    model, opt = _build(system, s)
    return _train(model, opt, s)


@contextmanager
def _marking_every_resize(mem: Any) -> Iterator[None]:
    """mark() `mem` after every `UntypedStorage.resize_`, which is no operator: the tracker's
    dispatch mode does not see FSDP free or re-allocate a gathered buffer with it."""
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        out = original(storage, size)
        mem.mark("resize_")
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


@contextmanager
def _c_stderr_silenced() -> Iterator[None]:
    """Kineto writes a 'USDT ... profiler_start/stop' line to file descriptor 2 each time."""
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _allocator_peak(prof: Any) -> int:
    """Highest running total of the CPU allocator's bytes in the profiler's memory events.

    A free on a thread the profiler does not watch (gloo's, when a finished collective drops
    the last reference to a buffer) is not reported, so over a long run this total drifts up
    while the process does not grow: hence only the first `PROFILED_STEPS` steps.
    """
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def memory_run(system: str, s: dict[str, Any]) -> dict[str, Any]:
    """One run of `steps` steps under two MemoryTrackers (and the profiler for the first)."""
    from torch.profiler import ProfilerActivity, profile

    from fsdp_lab.sharding import sharding_state
    from fsdp_lab.trace import MemoryTracker

    torch.set_num_threads(s["threads"])
    gc.collect()
    # The tracker reads .grad of every parameter; FSDP1's are non-leaf views between steps.
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    def stop_profiler(step: int) -> None:
        if step + 1 == min(PROFILED_STEPS, s["steps"]):
            with _c_stderr_silenced():
                prof.stop()

    with _c_stderr_silenced():
        prof.start()  # first: it counts only what is allocated after it starts
    from fsdp_lab import comm

    with (
        MemoryTracker() as lab_marks,
        MemoryTracker() as mem,
        _marking_every_resize(mem),
        comm.CommLog() as log,
    ):
        model, opt = _build(system, s)
        for tracker in (lab_marks, mem):
            tracker.track(model)
            tracker.track(opt)
            if system in OURS:  # as the shard lab does: gathered buffers are comm buffers
                for unit in sharding_state(model).units:
                    tracker.track(unit.flat.unsharded, "comm_buffers")
        at_wrap = len(log.records)  # "none" broadcasts rank 0's values at wrap, as DDP does
        out = _train(model, opt, s, after_step=stop_profiler)
    trace = mem.trace()
    sent = sum(comm.bytes_by_op(log.records[at_wrap:]).values()) / s["steps"]
    return {
        "peak_bytes": trace["peak_bytes"],
        "peak_by_category": trace["peak_by_category"],
        "lab_marks_peak_bytes": lab_marks.peak_bytes,
        "allocator_peak_bytes": _allocator_peak(prof),
        "final_loss": out["losses"][-1],
        "comm_bytes": sent,  # ours only: PyTorch's collectives do not pass through fsdp_lab.comm
    }


# -- in the driver ---------------------------------------------------------------------------


def step_time(per_rank: list[dict]) -> float:
    """Slowest rank per step, then the median over the steps after the first."""
    slowest = [max(steps) for steps in zip(*(r["step_s"] for r in per_rank), strict=True)]
    return statistics.median(slowest[1:] if len(slowest) > 1 else slowest)


def measure(n: int, s: dict[str, Any], repeats: int) -> dict[str, dict]:
    """Every system on one Cluster of `n` ranks: the timed repeats, then one memory run each."""
    out: dict[str, dict] = {system: {"step_time_s_per_repeat": []} for system in SYSTEMS}
    with Cluster(n, backend="gloo", timeout=600, verbose=False) as cluster:
        for r in range(repeats):
            print(f"  N={n} repeat {r + 1}/{repeats}, load average {_load()}", flush=True)
            for system in SYSTEMS:  # interleaved: noise hits every system alike
                t = step_time(cluster.run(timed_run, system, s))
                out[system]["step_time_s_per_repeat"].append(t)
                print(f"    {system:14} {t * 1e3:7.1f} ms/step", flush=True)
        for system in SYSTEMS:
            ranks = cluster.run(memory_run, system, s)
            res = out[system]
            res["step_time_s"] = statistics.median(res["step_time_s_per_repeat"])
            for key in ("peak_bytes", "lab_marks_peak_bytes", "allocator_peak_bytes"):
                res[key] = max(x[key] for x in ranks)
            res["peak_by_category"] = max(ranks, key=lambda x: x["peak_bytes"])["peak_by_category"]
            res["final_loss"] = statistics.fmean(x["final_loss"] for x in ranks)
            res["comm_bytes"] = ranks[0]["comm_bytes"]
            print(
                f"  N={n} memory {system:5} {res['peak_bytes'] / MiB:7.2f} MiB tracked", flush=True
            )
    return out


def _mib(b: float, sign: str = "") -> str:
    return f"{b / MiB:{sign}.2f}"


def _ratios(res: dict[str, dict], system: str, ref: str) -> list[float]:
    pairs = zip(
        res[system]["step_time_s_per_repeat"], res[ref]["step_time_s_per_repeat"], strict=True
    )
    return [a / b for a, b in pairs]


def _median_ratio(res: dict[str, dict], system: str, ref: str) -> float:
    return statistics.median(_ratios(res, system, ref))


def ratio(res: dict[str, dict], system: str, ref: str) -> str:
    """Step-time ratio repeat by repeat: "median (min-max)"."""
    ratios = _ratios(res, system, ref)
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def print_tables(n: int, res: dict[str, dict], psi: int) -> None:
    ref = res["fully_shard"]
    print(f"\nworld size {n} (gloo)\n")
    print(
        "| system | step time (ms, median; min-max over repeats) | ratio to fully_shard "
        "(median; min-max) | ratio to ddp | peak tracked memory (MiB) | ratio to fully_shard |"
    )
    print("|---|---|---|---|---|---|")
    for system in SYSTEMS:
        r = res[system]
        ms = [t * 1e3 for t in r["step_time_s_per_repeat"]]
        print(
            f"| {system} | {r['step_time_s'] * 1e3:.1f} ({min(ms):.0f}-{max(ms):.0f}) "
            f"| {ratio(res, system, 'fully_shard')} | {ratio(res, system, 'ddp')} "
            f"| {_mib(r['peak_bytes'])} | {r['peak_bytes'] / ref['peak_bytes']:.2f} |"
        )
    print("\npeak memory (MiB, highest rank) counted three ways, and what the tracker saw at it:\n")
    print(
        "| system | tracker marked at every resize_ (above) | tracker marked as in the shard lab "
        f"| CPU allocator, build + steps 1-{PROFILED_STEPS} | model state at the peak "
        "| activations at the peak | final loss |"
    )
    print("|---|---|---|---|---|---|---|")
    for system in SYSTEMS:
        r = res[system]
        cats = r["peak_by_category"]
        state = sum(cats[c] for c in ("parameters", "gradients", "optimizer_state", "comm_buffers"))
        print(
            f"| {system} | {_mib(r['peak_bytes'])} | {_mib(r['lab_marks_peak_bytes'])} "
            f"| {_mib(r['allocator_peak_bytes'])} | {_mib(state)} "
            f"| {_mib(cats['activations'] + cats['other'])} | {r['final_loss']:.6f} |"
        )
    print(
        f"\nformulas, Ψ = {psi:,} parameters, fp32 Adam: DDP 16Ψ = {_mib(16 * psi)} MiB "
        f"+ 4Ψ = {_mib(4 * psi)} MiB of gradient buckets; ZeRO-3 16Ψ/N = {_mib(16 * psi / n)} "
        "MiB + the gathered units; both + activations"
    )
    lab = ", ".join(
        f"{k} {_mib(res[k]['lab_marks_peak_bytes'] - res[k]['peak_bytes'], '+')}" for k in SYSTEMS
    )
    unseen = ", ".join(
        f"{k} {_mib(res[k]['allocator_peak_bytes'] - res[k]['peak_bytes'], '+')}" for k in SYSTEMS
    )
    print(f"tracker check (MiB): marked only as in the shard lab, the peak moves by {lab}")
    print(f"tracker check (MiB): the CPU allocator's peak exceeds the tracker's by {unseen}")


FOOTNOTE = f"""
How to read this:
- step time: per step the slowest rank (it sets the pace), median over the steps after the
  first, median over the repeats; timed runs carry no instrumentation.
- memory: live tensor storages (fsdp_lab.trace.MemoryTracker, started before the model is
  built), highest rank, in one extra run per system. The tracker sees a storage resized to
  0 bytes only at its next mark(). FSDP1, FSDP2 and ours free gathered parameters that way;
  ours marks right after, PyTorch does not, so a tracker marked only as in the shard lab
  (train_steps and ours) keeps counting PyTorch's freed buffers until the next step
  boundary. The table's tracker is marked after every resize_, for all four alike.
- CPU allocator (PyTorch's profiler, same run, build + steps 1-{PROFILED_STEPS}): also counts
  what no dispatch-mode tracker sees: temporaries inside an operator or inside DTensor's
  dispatch, gloo's staging buffers on its own threads. Frees on threads the profiler does
  not watch go unreported, so it would drift up over a longer window.
- split at the peak: autograd-made gradients and DDP's buckets (rebuilt in the second
  forward) are created as "activations" and re-filed by role only at a mark: approximate.
- final loss: mean over ranks after the last step; equal across systems = same model, data.
"""


def _load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch, split over ranks")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per rank (0: cores // N)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = parser.parse_args()
    for n in args.world_sizes:
        if args.batch % n:
            parser.error(f"--batch {args.batch} does not split evenly over {n} ranks")

    from fsdp_lab.models import GPTConfig, TinyGPT

    cores = os.cpu_count() or 1
    settings = {
        k: getattr(args, k) for k in ("steps", "dim", "layers", "heads", "vocab", "seq", "batch")
    }
    cfg = GPTConfig(args.vocab, args.seq, args.dim, args.layers, args.heads)
    psi = sum(p.numel() for p in TinyGPT(cfg).parameters())  # the tied weight once
    print(
        f"machine: {platform.machine()}, {cores} cores, torch {torch.__version__}, python {platform.python_version()}"
    )
    print(
        f"model: TinyGPT dim {args.dim}, {args.layers} layers, {args.heads} heads, vocab "
        f"{args.vocab}, seq {args.seq}, tied embedding/head: {psi:,} parameters, fp32, Adam"
    )
    print(
        f"run: world sizes {args.world_sizes} on gloo, global batch {args.batch}, {args.steps} "
        f"steps x {args.repeats} repeats per system, interleaved; torch threads per rank "
        f"{args.threads or 'cores // N'}"
    )
    print(f"load average (1, 5, 15 min) at the start: {_load()}")

    results: dict[int, dict] = {}
    for n in args.world_sizes:
        s = {**settings, "threads": args.threads or max(1, cores // n)}
        print(f"\nN={n}: {s['threads']} torch thread(s) per rank", flush=True)
        results[n] = measure(n, s, args.repeats)

    for n, res in results.items():
        print_tables(n, res, psi)
    print(FOOTNOTE.rstrip())
    print(f"load average (1, 5, 15 min) at the end: {_load()}")
    # Each goal on the table's own figures: step time as the median of the repeat-by-repeat
    # ratios (min-max beside it), peak memory from the one tracked run per system.
    goals = {
        "ours:full / fully_shard step time ≤ 0.85": ("ours:full", "fully_shard", 0.85),
        "ours:none / ddp step time ≤ 1.00": ("ours:none", "ddp", 1.0),
    }
    print()
    for goal, (a, b, limit) in goals.items():
        met = ", ".join(
            f"N={n}: {ratio(res, a, b)} "
            + ("met" if _median_ratio(res, a, b) <= limit else "not met")
            for n, res in results.items()
        )
        print(f"{goal}: {met}")
    memory = ", ".join(
        f"N={n}: {res['ours:full']['peak_bytes'] / res['fully_shard']['peak_bytes']:.4f} "
        + (
            "met"
            if res["ours:full"]["peak_bytes"] <= res["fully_shard"]["peak_bytes"]
            else "not met"
        )
        for n, res in results.items()
    )
    print(f"ours:full / fully_shard peak memory ≤ 1.00: {memory}")
    # ZeRO-3 sends more than DDP (a second all-gather for backward, reduce-scatter + all-gather
    # for all-reduce): its step-time ratio beside the bytes ratio that explains it. ours:none's
    # bytes are DDP's (the same all-reduces, bit-equal results).
    explained = ", ".join(
        f"N={n}: step time {res['ours:full']['step_time_s'] / res['ddp']['step_time_s']:.2f}, "
        + (
            f"bytes {res['ours:full']['comm_bytes'] / res['ours:none']['comm_bytes']:.2f}"
            if res["ours:none"]["comm_bytes"]
            else "no bytes (one rank)"
        )
        for n, res in results.items()
    )
    print(f"ours:full / ddp (no goal; bytes per step from ours:full / ours:none): {explained}")
    if args.json:
        payload = {
            "machine": {
                "cores": cores,
                "torch": torch.__version__,
                "platform": platform.platform(),
            },
            "settings": {**settings, "world_sizes": args.world_sizes, "repeats": args.repeats},
            "parameters": psi,
            "results": {str(n): res for n, res in results.items()},
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
