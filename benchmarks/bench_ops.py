"""Operators per training step and CPU step time: ours beside the plain model and `fully_shard`.

    python benchmarks/bench_ops.py [--world-sizes 1 2 4] [--steps 8] [--repeats 3]
        [--dim 64 --layers 2 --heads 4 --vocab 256 --seq 32 --batch 8] [--json PATH]

What a GPU pays for at one rank is operators: each one dispatched is at least a kernel launch
or a trip through the dispatcher, whatever its size. So this counts them, on the CPU, where no
GPU is needed: a `TorchDispatchMode` sees every ATen operator (views and collectives included)
of one training step — forward, loss, backward, optimizer step; the batch is made before —
after `WARMUP` steps (lazy init, optimizer state). Systems, the same TinyGPT, seed and data:

    plain        the model alone on the rank's share of the batch (no messages)
    ours         fsdp_lab.shard(model, units={Block}, strategy="full")
    fully_shard  fully_shard on every Block and the root, at FSDP2's defaults

each in fp32, and in bf16 mixed precision with fp32 gradient reduction (the plain model under
`torch.autocast`; ours `MixedPrecision(bfloat16, float32)`; FSDP2 `MixedPrecisionPolicy`).
The counts are rank 0's and do not depend on the machine.

Step time: `--repeats` runs per system and precision, interleaved (plain, ours, fully_shard,
plain, ...); per step the slowest rank, the median over the steps after the first `WARMUP`,
then the median over repeats. Timed runs carry no dispatch mode, which costs every operator.

No assertion: a benchmark reports, tests assert behaviour (`tests/test_op_counts.py`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYSTEMS = ("plain", "ours", "fully_shard")
PRECISIONS = ("fp32", "bf16")
WARMUP = 2  # steps before the counted or timed ones: lazy init, optimizer state
SMALL = {"dim": 64, "layers": 2, "heads": 4, "vocab": 256, "seq": 32, "batch": 8}


class OperatorCount(TorchDispatchMode):
    """Counts every ATen operator dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.by_name[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_name.values())


class Autocast(torch.nn.Module):
    """The plain model's mixed precision: fp32 weights, bf16 compute (`torch.autocast`)."""

    def __init__(self, inner: torch.nn.Module, device_type: str) -> None:
        super().__init__()
        self.inner, self.device_type = inner, device_type
        self.vocab_size = inner.vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.inner(x)


def build(
    system: str, cfg: dict[str, Any], precision: str, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """`system` (one of `SYSTEMS`, or "ours+offload") around the same seeded TinyGPT, with
    Adam, on `device`."""
    from fsdp_lab import MixedPrecision, reference
    from fsdp_lab.models import Block, GPTConfig, TinyGPT

    torch.manual_seed(0)
    shape = GPTConfig(cfg["vocab"], cfg["seq"], cfg["dim"], cfg["layers"], cfg["heads"])
    model: torch.nn.Module = TinyGPT(shape).to(device)  # ours shards where the model is
    bf16 = precision == "bf16"
    if system == "plain":
        model = Autocast(model, device.type) if bf16 else model
    elif system in ("ours", "ours+offload"):  # offload: every shard in host memory
        options = {"mixed_precision": MixedPrecision(torch.bfloat16, torch.float32)} if bf16 else {}
        options["offload"] = system == "ours+offload"
        model = reference.wrap(model, "ours:full", (Block,), **options)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else None
        options = {"mp_policy": policy} if policy else {}
        model = reference.wrap(model, "fully_shard", (Block,), **options)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def batches(cfg: dict[str, Any], steps: int, device: torch.device) -> list[tuple]:
    """This rank's share of each step's global batch (`cfg["batch"]`), made before any step is
    counted or timed."""
    import torch.distributed as dist

    from fsdp_lab.models import synthetic_batch
    from fsdp_lab.reference import local_slice

    rank, world = dist.get_rank(), dist.get_world_size()
    return [
        tuple(
            local_slice(t, rank, world).to(device)
            for t in synthetic_batch(cfg["vocab"], cfg["batch"], cfg["seq"], step)
        )
        for step in range(steps)
    ]


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple) -> None:
    """One step: forward, next-token loss, backward, optimizer step."""
    x, y = batch
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def count_ops(system: str, cfg: dict[str, Any], precision: str) -> dict[str, Any]:
    """On a rank (real or fake): the operators of one step after `WARMUP` steps."""
    from fsdp_lab.cluster.where import device as placed_device

    device = placed_device()
    model, optimizer = build(system, cfg, precision, device)
    steps = batches(cfg, WARMUP + 1, device)
    for batch in steps[:WARMUP]:
        train_step(model, optimizer, batch)
    with OperatorCount() as count:
        train_step(model, optimizer, steps[WARMUP])
    return {"total": count.total, "by_name": dict(count.by_name)}


def timed(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: list[tuple]
) -> list[float]:
    """This rank's time of each step, from a common start (on CUDA, to the GPU's end of it)."""
    import torch.distributed as dist

    dist.barrier()
    times = []
    for batch in steps:
        start = time.perf_counter()
        train_step(model, optimizer, batch)
        if batch[0].is_cuda:  # (offloaded parameters live on the host: ask the batch)
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def time_steps(system: str, cfg: dict[str, Any], precision: str) -> list[float]:
    """On a rank: this rank's time of each of `cfg["steps"]` steps, no dispatch mode."""
    from fsdp_lab.cluster.where import device as placed_device

    torch.set_num_threads(cfg["threads"])
    device = placed_device()
    model, optimizer = build(system, cfg, precision, device)
    return timed(model, optimizer, batches(cfg, cfg["steps"], device))


def measure(n: int, cfg: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Counts once per system and precision, then the interleaved timed repeats."""
    from fsdp_lab import Cluster

    out: dict[str, Any] = {p: {s: {"ms_per_repeat": []} for s in SYSTEMS} for p in PRECISIONS}
    with Cluster(n, backend="gloo", timeout=600, verbose=False) as cluster:
        for precision in PRECISIONS:
            for system in SYSTEMS:
                out[precision][system]["ops"] = cluster.run(count_ops, system, cfg, precision)[0]
        for r in range(repeats):
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            print(f"  {n} rank(s), repeat {r + 1}/{repeats}, load average {load}", flush=True)
            for precision in PRECISIONS:
                for system in SYSTEMS:  # interleaved: noise hits every system alike
                    per_rank = cluster.run(time_steps, system, cfg, precision)
                    slowest = [max(s) for s in zip(*per_rank, strict=True)]
                    ms = statistics.median(slowest[WARMUP:] or slowest) * 1e3
                    out[precision][system]["ms_per_repeat"].append(ms)
    return out


def ratios(res: dict[str, Any], system: str, ref: str) -> list[float]:
    """Step-time ratios repeat by repeat (each against the same repeat's `ref`)."""
    pairs = zip(res[system]["ms_per_repeat"], res[ref]["ms_per_repeat"], strict=True)
    return [a / b for a, b in pairs]


def print_table(n: int, res: dict[str, Any]) -> None:
    print(f"\n{n} rank(s), gloo on the CPU\n")
    print(
        "| precision | system | operators per step | / plain | / fully_shard "
        "| ms per step (median; min-max) | time / plain (median; min-max) "
        "| time / fully_shard (median; min-max) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for precision, systems in res.items():
        plain, fsdp2 = systems["plain"]["ops"]["total"], systems["fully_shard"]["ops"]["total"]
        for system, r in systems.items():
            ops, ms = r["ops"]["total"], r["ms_per_repeat"]
            spread = [
                f"{statistics.median(x):.2f} ({min(x):.2f}-{max(x):.2f})"
                for x in (ratios(systems, system, "plain"), ratios(systems, system, "fully_shard"))
            ]
            print(
                f"| {precision} | {system} | {ops} | {ops / plain:.3f} | {ops / fsdp2:.3f} "
                f"| {statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}) "
                f"| {spread[0]} | {spread[1]} |"
            )


def print_extra_operators(res: dict[str, Any], precision: str) -> None:
    """Where ours' operators differ from the plain model's, by name."""
    ours = collections.Counter(res[precision]["ours"]["ops"]["by_name"])
    ours.subtract(res[precision]["plain"]["ops"]["by_name"])
    diff = ", ".join(
        f"{name} {n:+d}" for name, n in sorted(ours.items(), key=lambda kv: -kv[1]) if n
    )
    print(f"ours - plain, {precision}, by operator: {diff or 'none'}")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any rank starts, what would fail (or measure nothing) later."""
    positive = ("repeats", "dim", "layers", "heads", "vocab", "seq", "batch")
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: expected 1 or more")
    if min(args.world_sizes) < 1:
        parser.error(f"--world-sizes {args.world_sizes}: expected ranks, 1 or more each")
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim} does not split into --heads {args.heads}")
    if args.steps <= WARMUP:
        parser.error(f"--steps {args.steps}: expected more than the {WARMUP} warm-up steps")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json}: no such folder to write it in")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    for name, default in SMALL.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per rank (0: cores // N)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = parser.parse_args()
    check_args(parser, args)
    if args.threads < 0:
        parser.error(f"--threads {args.threads}: expected 0 (cores // N) or more")
    for n in args.world_sizes:
        if args.batch % n:
            parser.error(f"--batch {args.batch} does not split evenly over {n} ranks")
    cores = os.cpu_count() or 1
    cfg = {k: getattr(args, k) for k in (*SMALL, "steps")}
    print(f"machine: {platform.machine()}, {cores} cores, torch {torch.__version__}")
    print(f"model: TinyGPT {SMALL | {k: cfg[k] for k in SMALL}}, Adam; {args.repeats} repeats")
    results = {}
    for n in args.world_sizes:
        threads = args.threads or max(1, cores // n)
        print(f"\n{n} rank(s): {threads} torch thread(s) per rank", flush=True)
        results[n] = measure(n, {**cfg, "threads": threads}, args.repeats)
    for n, res in results.items():
        print_table(n, res)
    if 1 in results:
        print()
        for precision in PRECISIONS:
            print_extra_operators(results[1], precision)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "torch": torch.__version__, "results": results}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
