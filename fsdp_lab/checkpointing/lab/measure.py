"""Lab 02, measured: every schedule on chains of N layers here, then ZeRO-3 chains on the ranks.

Bytes from `MemoryTracker`, calls and kept layer inputs from forward hooks
(`schedules.LayerInputCounter`), all-gathers from `fsdp_lab.comm`; gradients compared here.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint

from fsdp_lab import comm, reference, theory
from fsdp_lab.checkpointing import schedules
from fsdp_lab.checkpointing.lab.config import MODES, CheckpointConfig
from fsdp_lab.checkpointing.recompute import (
    CheckpointWrapper,
    checkpoint,
    checkpoint_modules,
    run_segments,
)
from fsdp_lab.cluster import (
    AttachedCluster,
    Cluster,
    borrow,
    device,
    intra_op_threads,
    rank,
    world_size,
)
from fsdp_lab.models import Chain, ChainLayer
from fsdp_lab.trace import MemoryTracker, category


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _root(n: int) -> int:
    """The textbook's C = k = round(√N): O(√N) kept inputs."""
    return max(1, round(math.sqrt(n)))


def _chain(config: CheckpointConfig, n: int) -> tuple[Chain, torch.Tensor]:
    """The same chain and batch (B, dim) for every run: seeded."""
    torch.manual_seed(0)
    return Chain(n, config.dim), torch.randn(config.batch, config.dim)


def measure_schedules(
    chain: Chain,
    x: torch.Tensor,
    runs: Sequence[schedules.Schedule],
    repeats: int = 5,
    traced: Collection[str] = (),
) -> list[dict[str, Any]]:
    """Each schedule of `runs` on `chain` and the batch `x` (B, dim): one table row each.

    Per schedule, in this order:
    1. one run under forward hooks: the layer calls, the advances (no_grad calls) of each layer
       and the most layer inputs alive, beside `theory.checkpoint_cost`'s. It also warms up
       (the first backward of a process starts autograd's machinery: store_all, run first,
       used to look slower than the schedules that recompute);
    2. `repeats` timed runs, neither hooks nor tracker (both slow every call): `time_s` is
       their median, `time_min_s`/`time_max_s` their spread, all measured wall-clock;
    3. one run under a `MemoryTracker`, a marker at every layer call ("L3" under grad, "adv
       L3" under no_grad): the peak activation bytes and the peak of everything it tracked
       (activations + gradients: the dashed "peak" line of `plots.plot_memory_trace`), from
       the one recording that `trace` keeps for the schedules named in `traced`;
    4. the largest gradient difference from the first schedule's (store_all: plain autograd).
    Intra-op threads are set to 1: on layers this small, threads only add contention noise.
    """
    layers, rows, base = list(chain.layers), [], {}
    with intra_op_threads(1):
        for schedule in runs:
            chain.zero_grad(set_to_none=True)  # .grad accumulates: each run's are its own
            with schedules.LayerInputCounter(layers) as counter:
                schedules.run_chain(layers, x, schedule, loss_fn=_loss)
            times = []
            for _ in range(max(repeats, 1)):
                chain.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                schedules.run_chain(layers, x, schedule, loss_fn=_loss)
                times.append(time.perf_counter() - t0)
            chain.zero_grad(set_to_none=True)
            trace = _marked_trace(layers, x, schedule)
            grads = {name: p.grad for name, p in chain.named_parameters()}
            base = base or grads  # the first schedule's: store_all, plain autograd
            predicted = theory.checkpoint_cost(schedule, len(layers))
            row = {
                "schedule": str(schedule),
                "n": len(layers),
                "stored_activations": counter.stored_activations,
                "forward_calls": counter.forward_calls,
                "advances": counter.advances,
                "repetitions": counter.repetitions,
                "theory_stored_activations": predicted.stored_activations,
                "theory_forward_calls": predicted.forward_calls,
                "time_s": statistics.median(times),
                "time_min_s": min(times),
                "time_max_s": max(times),
                "repeats": len(times),
                "peak_activation_bytes": max(trace["bytes"]["activations"]),
                "peak_total_bytes": trace["peak_bytes"],
                "max_abs_grad_diff": reference.max_abs_diff(grads, base),
            }
            if schedule.name == "revolve":  # Griewank–Walther's own counts, closed form
                row["theory_repetitions"] = theory.revolve_repetitions(len(layers), schedule.arg)
            if str(schedule) in traced:
                row["trace"] = trace
            rows.append(row)
    return rows


def _marked_trace(layers: list[nn.Module], x: torch.Tensor, schedule: schedules.Schedule) -> dict:
    """One forward + backward under a MemoryTracker, a marker at each layer call: "L3" for a
    call under grad (its internals kept for backward), "adv L3" for one under no_grad."""
    with MemoryTracker() as mem:

        def mark(i: int) -> Any:
            return lambda *_: mem.mark(f"L{i}" if torch.is_grad_enabled() else f"adv L{i}")

        handles = [m.register_forward_pre_hook(mark(i)) for i, m in enumerate(layers)]
        try:
            schedules.run_chain(layers, x, schedule, loss_fn=_loss)
        finally:
            for handle in handles:
                handle.remove()
    return mem.trace()


def schedules_for(config: CheckpointConfig, n: int) -> list[schedules.Schedule]:
    """The six schedules for a chain of `n`: C = k = round(√N) unless given; `optimal` keeps as
    many layer inputs as `segments(k)`, and `revolve` takes one snapshot fewer than optimal's
    budget, so that the three compete at equal kept inputs (s snapshots + the taped state)."""
    root = _root(n)
    k = config.segment or root
    budget = config.budget or theory.checkpoint_cost(schedules.segments(k), n).stored_activations
    budget = max(schedules.min_budget(n), min(budget, n))
    snapshots = config.snapshots or max(1, budget - 1)
    return [
        schedules.store_all,
        schedules.full_recompute,
        schedules.every(config.every or root),
        schedules.segments(k),
        schedules.optimal(budget),
        schedules.revolve(min(snapshots, n)),
    ]


def binomial_law(max_snapshots: int = 3, max_repetitions: int = 3) -> list[dict[str, Any]]:
    """Griewank's law measured: for s snapshots and r repetitions, revolve(s) on a chain of
    l = C(s + r, s) layers (the longest the law allows with r) and on one of l + 1 layers."""
    rows = []
    for s in range(1, max_snapshots + 1):
        for r in range(1, max_repetitions + 1):
            steps = theory.binomial_reach(s, r)
            rows.append(
                {
                    "snapshots": s,
                    "repetitions": r,
                    "at": _counted_revolve(steps, s),
                    "past": _counted_revolve(steps + 1, s),
                }
            )
    return rows


def _counted_revolve(steps: int, snapshots: int) -> dict[str, int]:
    """revolve(snapshots) on a tiny chain (B=4, dim=8: counts only) of `steps` layers: the
    advances, the most advances of one layer and the kept inputs (hooks), with the theory's."""
    torch.manual_seed(0)
    chain, x = Chain(steps, 8), torch.randn(4, 8)
    with schedules.LayerInputCounter(chain.layers) as counter:
        schedules.run_chain(chain.layers, x, schedules.revolve(snapshots), loss_fn=_loss)
    return {
        "steps": steps,
        "advances": counter.advances,
        "repetitions": counter.repetitions,
        "stored_activations": counter.stored_activations,
        "theory_advances": theory.revolve_advances(steps, snapshots),
        "theory_repetitions": theory.revolve_repetitions(steps, snapshots),
    }


def _versus_torch(config: CheckpointConfig, n: int) -> dict[str, Any]:
    """Our autograd-integrated `checkpoint` vs torch.utils.checkpoint on segments of k layers,
    and store-all. Parameter gradients exist before tracking, so backward adds into them in place:
    the column holds the activations and the gradients flowing between layers, not .grad."""
    k = config.segment or _root(n)
    theirs = functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)
    peaks, grads = {}, {}
    runs = (
        ("store_all", None, checkpoint),
        ("ours", k, checkpoint),
        ("torch", k, theirs),
    )
    for who, segment, fn in runs:
        chain, x = _chain(config, n)
        for p in chain.parameters():
            p.grad = torch.zeros_like(p)
        with MemoryTracker() as mem, category("activations"):
            _loss(run_segments(chain.layers, x, segment, checkpoint_fn=fn)).backward()
        peaks[f"{who}_peak_activation_bytes"] = max(mem.trace()["bytes"]["activations"])
        grads[who] = {name: p.grad for name, p in chain.named_parameters()}
    diff = reference.max_abs_diff(grads["ours"], grads["torch"])
    return {"k": k, **peaks, "max_abs_grad_diff_ours_vs_torch": diff}


def sharded_chain_worker(
    mode: str, n_layers: int = 4, dim: int = 16, steps: int = 2
) -> dict[str, Any]:
    """On every rank: a ZeRO-3 chain (one unit per layer) trained with checkpointing `mode`.

    "plain" no checkpointing; "unit_wraps_checkpoint" the checkpoint inside each unit (wrap
    first, then shard: torchtitan's order); "checkpoint_spans_two_units" one checkpoint over
    two units, which recomputes the first unit before its backward gather: an extra gather.
    """
    from fsdp_lab.sharding import shard

    torch.manual_seed(0)
    model = Chain(n_layers, dim).to(device())  # the same values on every rank: seeded on CPU
    if mode == "unit_wraps_checkpoint":  # torchtitan's apply_ac, then apply_fsdp
        checkpoint_modules(model, lambda _, m: isinstance(m, ChainLayer))
        shard(model, units={CheckpointWrapper})
    else:
        shard(model, units={ChainLayer})
    if mode == "checkpoint_spans_two_units":  # one checkpoint around each pair of units
        model.forward = functools.partial(run_segments, list(model.layers), segment_size=2)
    r, n = rank(), world_size()
    x = torch.randn(8 * n, dim, generator=torch.Generator().manual_seed(1)).to(device())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with comm.CommLog() as log:
        for _ in range(steps):
            opt.zero_grad()
            _loss(model(reference.local_slice(x, r, n))).backward()
            opt.step()
    params = {k.replace("module.", ""): v for k, v in reference.full_parameters(model).items()}
    gather = "all_gather_into_tensor"  # none on one rank: the shard is the whole parameter
    return {
        "mode": mode,
        "all_gather_calls_per_step": log.calls_by_op().get(gather, 0) / steps,
        "all_gather_bytes_per_step": log.bytes_by_op().get(gather, 0.0) / steps,
        "params": params,
    }


def measure(
    config: CheckpointConfig, cluster: Cluster | AttachedCluster | None = None
) -> dict[str, Any]:
    """Every schedule for each N and the torch comparison here; then each mode trained on
    `cluster` (or on ranks started for it; world_size 0 and no cluster skip that part)."""
    chains, traces = {}, {}
    for n in config.layers:
        chain, x = _chain(config, n)
        # The shortest chain's store_all and segments(√N) are drawn over time: their recordings
        # are the very runs whose peaks the table shows.
        traced = (str(schedules.store_all), str(schedules.segments(_root(n))))
        rows = measure_schedules(chain, x, schedules_for(config, n), traced=traced)
        if n == config.layers[0]:
            traces = {r["schedule"]: r.pop("trace") for r in rows if "trace" in r}
        for r in rows:
            r.pop("trace", None)
        chains[str(n)] = {"rows": rows, "versus_torch": _versus_torch(config, n)}
    sharding = None
    if config.world_size > 0 or cluster is not None:
        units = 4
        with borrow(cluster, config.world_size, config.backend) as ranks:
            runs = {m: ranks.run(sharded_chain_worker, m, units)[0] for m in MODES}
        sharding = {
            m: {
                "units": units,
                "world_size": ranks.world_size,
                "all_gather_calls_per_step": r["all_gather_calls_per_step"],
                "all_gather_bytes_per_step": r["all_gather_bytes_per_step"],
                "max_abs_param_diff_vs_plain": reference.max_abs_diff(
                    r["params"], runs["plain"]["params"]
                ),
            }
            for m, r in runs.items()
        }
    return {
        "chains": chains,
        "memory_traces": traces,
        "binomial_law": binomial_law(),
        "with_sharding": sharding,
    }
