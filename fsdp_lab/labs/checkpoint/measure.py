"""Lab 02, measured: every schedule on chains of N layers here, then ZeRO-3 chains on the ranks.

Bytes from `MemoryTracker`, calls and kept layer inputs from forward hooks
(`schedules.LayerInputCounter`), all-gathers from `fsdp_lab.comm`; gradients compared here.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from fsdp_lab import comm, reference, schedules, theory
from fsdp_lab.checkpointing import CheckpointWrapper, checkpoint, checkpoint_modules, run_segments
from fsdp_lab.cluster import (
    AttachedCluster,
    Cluster,
    borrow,
    device,
    intra_op_threads,
    rank,
    world_size,
)
from fsdp_lab.labs.checkpoint.config import MODES, CheckpointConfig
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
    chain: Chain, x: torch.Tensor, runs: Sequence[schedules.Schedule], repeats: int = 3
) -> list[dict[str, Any]]:
    """Each schedule of `runs` on `chain` and the batch `x` (B, dim): one table row each.

    A row holds the layer calls and the most layer inputs alive (forward hooks) beside
    `theory.checkpoint_cost`'s; `time_s`, the fastest of `repeats` runs (on a busy CPU,
    contention adds noise, never speed); the peak activation bytes of one more run under a
    `MemoryTracker` (it slows every op: timing is done without it); and the largest gradient
    difference from the first schedule's (store_all: plain autograd).
    """
    layers, rows, base = list(chain.layers), [], {}
    for schedule in runs:
        times = []
        for _ in range(repeats):
            chain.zero_grad(set_to_none=True)  # .grad accumulates: each run's are its own
            with schedules.LayerInputCounter(layers) as counter:
                t0 = time.perf_counter()
                schedules.run_chain(layers, x, schedule, loss_fn=_loss)
                times.append(time.perf_counter() - t0)
        chain.zero_grad(set_to_none=True)
        with MemoryTracker() as mem:
            schedules.run_chain(layers, x, schedule, loss_fn=_loss)
            activations = mem.trace()["bytes"]["activations"]  # a sample at every alloc and free
        grads = {name: p.grad for name, p in chain.named_parameters()}
        base = base or grads  # the first schedule's: store_all, plain autograd
        predicted = theory.checkpoint_cost(schedule, len(layers))
        rows.append(
            {
                "schedule": str(schedule),
                "n": len(layers),
                "stored_activations": counter.stored_activations,
                "forward_calls": counter.forward_calls,
                "theory_stored_activations": predicted.stored_activations,
                "theory_forward_calls": predicted.forward_calls,
                "time_s": min(times),
                "peak_activation_bytes": max(activations),
                "max_abs_grad_diff": reference.max_abs_diff(grads, base),
            }
        )
    return rows


def schedules_for(config: CheckpointConfig, n: int) -> list[schedules.Schedule]:
    """The five schedules for a chain of `n`: C = k = round(√N) unless given, and `optimal`
    keeps as many layer inputs as `segments(k)`, so the two compete at equal slots."""
    root = _root(n)
    k = config.segment or root
    budget = config.budget or theory.checkpoint_cost(schedules.segments(k), n).stored_activations
    return [
        schedules.store_all,
        schedules.full_recompute,
        schedules.every(config.every or root),
        schedules.segments(k),
        schedules.optimal(max(schedules.min_budget(n), min(budget, n))),
    ]


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


def _traces(config: CheckpointConfig, n: int) -> dict[str, Any]:
    """One forward+backward under the tracker: store-all vs segments(√N)."""
    out = {}
    for schedule in (schedules.store_all, schedules.segments(_root(n))):
        chain, x = _chain(config, n)
        with MemoryTracker() as mem:
            schedules.run_chain(chain.layers, x, schedule, loss_fn=_loss)
        out[str(schedule)] = mem.trace()
    return out


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
    chains = {}
    for n in config.layers:
        chain, x = _chain(config, n)
        with intra_op_threads(1):  # small layers: intra-op threads only add contention noise
            rows = measure_schedules(chain, x, schedules_for(config, n))
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
    traces = _traces(config, config.layers[0])
    return {"chains": chains, "memory_traces": traces, "with_sharding": sharding}
