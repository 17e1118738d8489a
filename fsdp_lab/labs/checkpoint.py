"""Lab 02 — activation checkpointing: recompute instead of store, every textbook schedule.

For chains of N layers (default 8, 16, 32): each schedule of `fsdp_lab.schedules` is run and
measured — peak activation bytes (MemoryTracker), layer forward calls (hooks), time — with
its gradients compared to store-all, and its (memory, calls) predicted by `theory`. Then our
autograd-integrated `checkpoint` against `torch.utils.checkpoint` on the same segments, and a
sharded chain on real ranks: where the checkpoint sits relative to a wrap unit decides
whether the recompute costs an extra all-gather.

[Note: the textbook table] "store all O(N) memory / O(N) compute; recompute all O(1) / O(N²);
checkpoint every C layers O(C) / O(N²/C); √N" mixes two schemes: its "every C" row recomputes
each layer from its nearest checkpoint (our `every(C)`), but the √N row is Chen et al.'s
segments, recomputed once each (`segments(k)`, O(N/k + k) memory for one extra forward).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from fsdp_lab import comm, reference, schedules, theory
from fsdp_lab.checkpointing import CheckpointWrapper, checkpoint, run_segments
from fsdp_lab.cluster import AttachedCluster, Cluster, intra_op_threads, rank, world_size
from fsdp_lab.labs import LabResult
from fsdp_lab.labs.checkpoint_config import CheckpointConfig
from fsdp_lab.models import Chain, ChainLayer
from fsdp_lab.trace import MemoryTracker, category


def schedules_for(config: CheckpointConfig, n: int) -> list[schedules.Schedule]:
    root = max(1, round(math.sqrt(n)))
    k = config.segment or root
    budget = config.budget or theory.checkpoint_cost(schedules.segments(k), n).stored_activations
    budget = max(schedules.min_budget(n), min(budget, n))
    return [
        schedules.store_all,
        schedules.full_recompute,
        schedules.every(config.every or root),
        schedules.segments(k),
        schedules.optimal(budget),
    ]


def _chain(config: CheckpointConfig, n: int) -> tuple[Chain, torch.Tensor]:
    torch.manual_seed(0)
    return Chain(n, config.dim), torch.randn(config.batch, config.dim)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def measure_chain(config: CheckpointConfig, n: int) -> dict[str, Any]:
    """Every schedule on one chain: a row each, gradients compared with store-all."""
    chain, x = _chain(config, n)
    rows, grads = [], {}
    with intra_op_threads(1):  # small layers: intra-op threads only add contention noise
        for schedule in schedules_for(config, n):
            row = schedules.measure_schedule(
                chain.layers, x, schedule, loss_fn=_loss, keep_grads=True
            )
            grads[row["schedule"]] = row.pop("grads")
            rows.append(row)
    base = grads["store_all"]
    for row in rows:
        got = grads[row["schedule"]]
        row["max_abs_grad_diff"] = max((got[k] - base[k]).abs().max().item() for k in base)
    frontier = [
        asdict(theory.checkpoint_cost(schedules.optimal(b), n)) | {"budget": b}
        for b in range(schedules.min_budget(n), n + 1)
    ]
    return {"n": n, "rows": rows, "frontier": frontier, "versus_torch": _versus_torch(config, n)}


def _segments_run(config: CheckpointConfig, n: int, k: int | None, fn: Any) -> dict[str, Any]:
    chain, x = _chain(config, n)
    # Parameter gradients exist before tracking, so backward adds into them in place: the
    # column then holds the activations and the gradients flowing between layers, not .grad.
    for p in chain.parameters():
        p.grad = torch.zeros_like(p)
    with MemoryTracker() as mem, category("activations"):
        _loss(run_segments(chain.layers, x, k, checkpoint_fn=fn)).backward()
    grads = {name: p.grad.clone() for name, p in chain.named_parameters()}
    return {"peak": max(mem.trace()["bytes"]["activations"]), "grads": grads}


def _versus_torch(config: CheckpointConfig, n: int) -> dict[str, Any]:
    """Our checkpoint vs torch.utils.checkpoint on the same segments of k layers."""
    k = config.segment or max(1, round(math.sqrt(n)))

    def theirs(fn: Any, *args: Any) -> Any:
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False)

    store, ours, torch_ = (
        _segments_run(config, n, None, checkpoint),
        _segments_run(config, n, k, checkpoint),
        _segments_run(config, n, k, theirs),
    )
    diff = max((ours["grads"][p] - torch_["grads"][p]).abs().max().item() for p in ours["grads"])
    return {
        "k": k,
        "store_all_peak_activation_bytes": store["peak"],
        "ours_peak_activation_bytes": ours["peak"],
        "torch_peak_activation_bytes": torch_["peak"],
        "peak_ratio_ours_to_torch": ours["peak"] / torch_["peak"],
        "max_abs_grad_diff_ours_vs_torch": diff,
    }


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
    model = Chain(n_layers, dim)
    if mode == "unit_wraps_checkpoint":
        for i, layer in enumerate(model.layers):
            model.layers[i] = CheckpointWrapper(layer)
        shard(model, units={CheckpointWrapper})
    else:
        shard(model, units={ChainLayer})
    if mode == "checkpoint_spans_two_units":
        layers = list(model.layers)

        def forward(x: torch.Tensor) -> torch.Tensor:
            for a in range(0, len(layers), 2):
                x = checkpoint(lambda y, pair=layers[a : a + 2]: pair[-1](pair[0](y)), x)
            return x

        model.forward = forward
    r, n = rank(), world_size()
    x = torch.randn(8 * n, dim, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with comm.CommLog() as log:
        for _ in range(steps):
            opt.zero_grad()
            _loss(model(reference.local_slice(x, r, n))).backward()
            opt.step()
    params = {k.replace("module.", ""): v for k, v in reference.full_parameters(model).items()}
    return {
        "mode": mode,
        "all_gather_calls_per_step": log.calls_by_op()["all_gather_into_tensor"] / steps,
        "all_gather_bytes_per_step": log.bytes_by_op()["all_gather_into_tensor"] / steps,
        "params": params,
    }


MODES = ("plain", "unit_wraps_checkpoint", "checkpoint_spans_two_units")


def _with_sharding(cluster: Cluster | AttachedCluster) -> dict[str, Any]:
    units = 4
    runs = {m: cluster.run(sharded_chain_worker, m, units)[0] for m in MODES}
    base = runs["plain"]["params"]
    return {
        m: {
            "units": units,
            # ZeRO-3: forward + backward gather per unit; a checkpoint over a pair adds one.
            "theory_all_gather_calls_per_step": 2 * units
            + (units // 2 if m == "checkpoint_spans_two_units" else 0),
            "all_gather_calls_per_step": r["all_gather_calls_per_step"],
            "all_gather_bytes_per_step": r["all_gather_bytes_per_step"],
            "max_abs_param_diff_vs_plain": max(
                (r["params"][k] - base[k]).abs().max().item() for k in base
            ),
        }
        for m, r in runs.items()
    }


def run(
    config: CheckpointConfig = CheckpointConfig(), cluster: Cluster | AttachedCluster | None = None
) -> LabResult:
    """Measure every schedule for each N; compare with torch; the sharded part on `cluster`."""
    chains = {str(n): measure_chain(config, n) for n in config.layers}
    sharding = None
    if config.world_size > 0 or cluster is not None:
        owned = cluster is None
        cluster = cluster or Cluster(config.world_size, config.backend)
        try:
            sharding = _with_sharding(cluster)
        finally:
            if owned:
                cluster.close()
    traces = _traces(config, config.layers[0])
    return LabResult(
        "checkpoint",
        {
            "config": asdict(config),
            "chains": chains,
            "schedules": {
                n: {
                    row["schedule"]: {
                        k: row[k]
                        for k in (
                            "peak_activation_bytes",
                            "forward_calls",
                            "time_s",
                            "max_abs_grad_diff",
                        )
                    }
                    for row in c["rows"]
                }
                for n, c in chains.items()
            },
            "with_sharding": sharding,
            "memory_traces": traces,
        },
    )


def _traces(config: CheckpointConfig, n: int) -> dict[str, Any]:
    """One forward+backward under the tracker: store-all vs segments(√N)."""
    out = {}
    for schedule in (schedules.store_all, schedules.segments(max(1, round(math.sqrt(n))))):
        chain, x = _chain(config, n)
        with MemoryTracker() as mem:
            schedules.run_chain(chain.layers, x, schedule, loss_fn=_loss)
        out[str(schedule)] = mem.trace()
    return out


def figures(result: LabResult) -> dict[str, Any]:
    from fsdp_lab import plots

    figs = {"memory_vs_compute": plots.plot_memory_vs_compute(result["chains"])}
    for name, trace in result["memory_traces"].items():
        figs[f"trace_{name.replace('(', '_').replace(')', '')}"] = plots.plot_memory_trace(
            trace, title=f"one forward + backward, {name}"
        )
    return figs


def summary(result: LabResult) -> str:
    from fsdp_lab.sizes import format_bytes

    lines = []
    for n, chain in result["chains"].items():
        lines += [
            f"### N = {n}",
            "",
            "| schedule | peak activations | calls (theory) | kept (theory) | time | max grad diff |",
            "|---|---|---|---|---|---|",
        ]
        for r in chain["rows"]:
            lines.append(
                f"| {r['schedule']} | {format_bytes(r['peak_activation_bytes'])} | {r['forward_calls']} "
                f"({r['theory_forward_calls']}) | {r['stored_activations']} ({r['theory_stored_activations']}) "
                f"| {r['time_s'] * 1e3:.1f} ms | {r['max_abs_grad_diff']:.1e} |"
            )
        v = chain["versus_torch"]
        lines += [
            "",
            f"segments of {v['k']}: ours {format_bytes(v['ours_peak_activation_bytes'])} vs "
            f"torch.utils.checkpoint {format_bytes(v['torch_peak_activation_bytes'])} "
            f"(ratio {v['peak_ratio_ours_to_torch']:.3f}), max grad diff {v['max_abs_grad_diff_ours_vs_torch']:.1e}",
            "",
        ]
    if result["with_sharding"]:
        lines += [
            "### ZeRO-3 chain with checkpointing",
            "",
            "| mode | all-gathers/step (counted) | bytes/step |",
            "|---|---|---|",
        ]
        for mode, s in result["with_sharding"].items():
            lines.append(
                f"| {mode} | {s['all_gather_calls_per_step']:g} "
                f"({s['theory_all_gather_calls_per_step']}) "
                f"| {format_bytes(s['all_gather_bytes_per_step'])} |"
            )
    return "\n".join(lines)
