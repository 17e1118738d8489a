"""Lab 01 — FSDP / ZeRO from scratch, trained on real ranks, checked and measured.

One run: the same model and data trained three ways —
  1. single process, whole batch                  (the ground truth)
  2. `fsdp_lab.shard` on N ranks, one strategy     (ours: every byte counted, memory traced)
  3. PyTorch's `fully_shard` (FSDP2) on N ranks    (the real thing)
— then compared parameter by parameter, and our measured memory and bytes per step set
beside DESIGN.md's formulas (Ψ parameters, N ranks, b bytes per element).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from dataclasses import asdict
from typing import Any

import torch

from fsdp_lab import comm, reference
from fsdp_lab.cluster import AttachedCluster, Cluster, device, rank, world_size
from fsdp_lab.labs import LabResult
from fsdp_lab.labs.model_spec import load_factory
from fsdp_lab.labs.shard_config import ShardConfig
from fsdp_lab.sharding import shard, sharding_state
from fsdp_lab.trace import MemoryTracker, Timeline

MODEL_STATE = ("parameters", "gradients", "optimizer_state", "comm_buffers")


def _unit_classes(model: torch.nn.Module) -> tuple[type, ...]:
    """Wrap the repeated blocks (the ModuleList children), as one does for a transformer."""
    blocks = {
        type(m) for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst
    }
    return tuple(blocks)


def _optimizer(cfg: ShardConfig, params: Any) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)


def _timed_training(
    cfg: ShardConfig, model: torch.nn.Module, opt: Any
) -> tuple[list[float], float]:
    stamps = [time.perf_counter()]
    losses = reference.train_steps(
        model,
        opt,
        cfg.steps,
        global_batch=cfg.global_batch,
        rank=rank(),
        world=world_size(),
        device=device(),
        on_step=lambda _: stamps.append(time.perf_counter()),
    )
    per_step = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    # The first step records the unit order and creates the optimizer state: leave it out.
    return losses, statistics.median(per_step[1:] if len(per_step) > 1 else per_step)


def _ours(cfg: ShardConfig) -> dict[str, Any]:
    factory = load_factory(cfg.model)
    with MemoryTracker(device(), rank=rank()) as mem, comm.CommLog() as log, Timeline(rank()) as tl:
        model = factory().to(device())
        units = _unit_classes(model)
        shard(model, units=set(units) or None, strategy=cfg.strategy, prefetch=cfg.prefetch)
        at_wrap = len(log.records)  # "none" broadcasts rank 0's values here, as DDP does
        opt = _optimizer(cfg, model.parameters())
        mem.track(model)
        mem.track(opt)
        state = sharding_state(model)
        for unit in state.units:
            if not unit.flat.aliased:  # DDP's buffer is the parameter itself
                mem.track(unit.flat.unsharded, "comm_buffers")  # its .grad as "gradients"
        mem.mark("sharded")
        losses, _ = _timed_training(cfg, model, opt)
    trace = mem.trace()
    # Timed again without the tracker, whose dispatch mode and marks cost more than a step.
    timed = factory().to(device())
    shard(timed, units=set(units) or None, strategy=cfg.strategy, prefetch=cfg.prefetch)
    _, step_time = _timed_training(cfg, timed, _optimizer(cfg, timed.parameters()))
    model_state = [sum(trace["bytes"][c][i] for c in MODEL_STATE) for i in range(len(trace["t"]))]
    return {
        "losses": losses,
        "step_time_s": step_time,
        "params": reference.full_parameters(model),
        "comm_bytes_per_step": {op: b / cfg.steps for op, b in _by_op(log.records[at_wrap:])},
        "calls_per_step": {
            op: c / cfg.steps for op, c in Counter(r.op for r in log.records[at_wrap:]).items()
        },
        "comm_bytes_at_wrap": dict(_by_op(log.records[:at_wrap])),
        "memory_trace": trace,
        "peak_bytes": trace["peak_bytes"],
        "peak_model_state_bytes": max(model_state),
        "timeline": tl.to_dict(),
        "units": [
            {
                "name": u.label,
                "numel": u.flat.numel,
                "padded_numel": u.flat.padded_numel,
                "shard_numel": u.flat.shard_numel,
                "element_size": u.flat.shard.element_size(),
            }
            for u in state.units
        ],
    }


def _by_op(records: list[comm.CommRecord]) -> list[tuple[str, float]]:
    totals: dict[str, float] = {}
    for r in records:
        totals[r.op] = totals.get(r.op, 0.0) + r.bytes
    return list(totals.items())


def _fsdp2(cfg: ShardConfig) -> dict[str, Any]:
    model = load_factory(cfg.model)().to(device())
    reference.apply_fsdp2(model, _unit_classes(model))
    opt = _optimizer(cfg, model.parameters())
    losses, step_time = _timed_training(cfg, model, opt)
    return {"losses": losses, "step_time_s": step_time, "params": reference.full_parameters(model)}


def _single_process(cfg: ShardConfig) -> dict[str, torch.Tensor]:
    model = load_factory(cfg.model)()
    opt = _optimizer(cfg, model.parameters())
    reference.train_steps(model, opt, cfg.steps, global_batch=cfg.global_batch)
    return {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        raise ValueError(f"parameter names differ: {sorted(set(a) ^ set(b))}")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _same_bytes(measured: dict[str, float], formula: dict[str, float]) -> bool:
    # Equal up to float rounding of the (N-1)/N factor summed over units and steps.
    return set(measured) == set(formula) and all(
        math.isclose(measured[k], formula[k], rel_tol=1e-12) for k in formula
    )


def theory(strategy: str, units: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """DESIGN.md's per-rank formulas for this model: bytes per step per collective, peak state."""
    b = units[0]["element_size"]
    psi = sum(u["numel"] for u in units)
    psi_padded = sum(u["padded_numel"] for u in units)
    largest = max(u["padded_numel"] for u in units) * b
    f = (n - 1) / n
    if strategy == "none":
        comm_bytes = {"all_reduce": 2 * f * psi * b}
        unpadded = dict(comm_bytes)
    else:
        gathers = 2 if strategy == "full" else 1
        comm_bytes = {
            "all_gather_into_tensor": gathers * f * psi_padded * b,
            "reduce_scatter_tensor": f * psi_padded * b,
        }
        unpadded = {
            "all_gather_into_tensor": gathers * f * psi * b,
            "reduce_scatter_tensor": f * psi * b,
        }
    # fp32 Adam: 4 B parameter + 4 B gradient + 8 B optimizer state per parameter.
    peak = {
        "none": 16 * psi,
        "optimizer": 8 * psi + 8 * psi / n,
        "grad_op": 4 * psi + 12 * psi / n,
        "full": 16 * psi / n + (largest if n > 1 else 0),  # one rank gathers nothing
    }[strategy]
    return {
        "psi": psi,
        "psi_padded": psi_padded,
        "bytes_per_element": b,
        "largest_unit_bytes": largest,
        "comm_bytes": comm_bytes,
        "comm_bytes_unpadded": unpadded,
        "peak_model_state_bytes": peak,
    }


def run(
    config: ShardConfig = ShardConfig(), cluster: Cluster | AttachedCluster | None = None
) -> LabResult:
    """Train ours, FSDP2 and a single process on the same model and data; compare; measure."""
    owned = cluster is None
    cluster = cluster or Cluster(config.world_size, config.backend)
    try:
        n = cluster.world_size
        if config.global_batch % n:
            raise ValueError(f"global_batch={config.global_batch} does not divide over {n} ranks")
        ours = cluster.run(_ours, config)
        fsdp2 = cluster.run(_fsdp2, config) if config.compare_fsdp2 else None
    finally:
        if owned:
            cluster.close()
    single = _single_process(config)
    th = theory(config.strategy, ours[0]["units"], n)
    data: dict[str, Any] = {
        "config": {**asdict(config), "world_size": n},
        "world_size": n,
        "strategy": config.strategy,
        "backend": cluster.backend,
        "max_abs_diff_vs_single_process": max_abs_diff(ours[0]["params"], single),
        "max_abs_diff_vs_fsdp2": max_abs_diff(ours[0]["params"], fsdp2[0]["params"])
        if fsdp2
        else None,
        "fsdp2_max_abs_diff_vs_single_process": max_abs_diff(fsdp2[0]["params"], single)
        if fsdp2
        else None,
        "peak_bytes_per_rank": [o["peak_bytes"] for o in ours],
        "peak_model_state_bytes_per_rank": [o["peak_model_state_bytes"] for o in ours],
        "theory_peak_bytes": th["peak_model_state_bytes"],
        "comm_bytes_per_rank": [o["comm_bytes_per_step"] for o in ours],
        "theory_comm_bytes": th["comm_bytes"],
        "theory_comm_bytes_unpadded": th["comm_bytes_unpadded"],
        "comm_matches_theory": all(
            _same_bytes(o["comm_bytes_per_step"], th["comm_bytes"]) for o in ours
        ),
        "calls_per_step": ours[0]["calls_per_step"],
        "theory": th,
        "units": ours[0]["units"],
        "losses_per_rank": [o["losses"] for o in ours],
        "step_time_s": max(o["step_time_s"] for o in ours),
        "fsdp2_step_time_s": max(f["step_time_s"] for f in fsdp2) if fsdp2 else None,
        "memory_traces": [o["memory_trace"] for o in ours],
        "timelines": [o["timeline"] for o in ours],
    }
    return LabResult("shard", data)


def figures(result: LabResult) -> dict[str, Any]:
    from fsdp_lab import plots

    return {
        "memory_trace": plots.plot_memory_trace(
            result["memory_traces"],
            title=f"{result['strategy']} on {result['world_size']} ranks",
            theory={"DESIGN.md formula": result["theory_peak_bytes"]},
        ),
        "bytes_vs_theory": plots.plot_measured_vs_theory(
            result["comm_bytes_per_rank"][0],
            result["theory_comm_bytes"],
            title="bytes per step per collective (rank 0)",
        ),
        "timeline": plots.plot_timeline(result["timelines"], title="compute and communication"),
    }


def summary(result: LabResult) -> str:
    from fsdp_lab.plots import format_bytes

    lines = [
        f"strategy {result['strategy']} on {result['world_size']} ranks ({result['backend']})",
        "",
        f"- max |ours - single process| = {result['max_abs_diff_vs_single_process']:.3g}",
    ]
    if result["max_abs_diff_vs_fsdp2"] is not None:
        lines.append(f"- max |ours - FSDP2| = {result['max_abs_diff_vs_fsdp2']:.3g}")
        lines.append(
            f"- step time: ours {result['step_time_s'] * 1e3:.1f} ms, "
            f"FSDP2 {result['fsdp2_step_time_s'] * 1e3:.1f} ms"
        )
    peaks = ", ".join(format_bytes(b) for b in result["peak_model_state_bytes_per_rank"])
    lines += [
        f"- peak model state per rank: {peaks} (formula {format_bytes(result['theory_peak_bytes'])})",
        "",
        "| collective | measured bytes/step (rank 0) | theory | calls/step |",
        "|---|---|---|---|",
    ]
    for op, t in result["theory_comm_bytes"].items():
        m = result["comm_bytes_per_rank"][0].get(op, 0.0)
        lines.append(
            f"| {op} | {format_bytes(m)} | {format_bytes(t)} | {result['calls_per_step'].get(op, 0):g} |"
        )
    lines.append(f"\nmeasured equals theory on every rank: {result['comm_matches_theory']}")
    return "\n".join(lines)
