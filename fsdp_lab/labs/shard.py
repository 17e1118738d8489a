"""Lab 01 — FSDP / ZeRO from scratch, trained on real ranks, checked and measured.

One run: the same model and data trained three ways —
  1. single process, whole batch                  (the ground truth)
  2. `fsdp_lab.shard` on N ranks, one strategy     (ours: every byte counted, memory traced)
  3. PyTorch's `fully_shard` (FSDP2) on N ranks    (the real thing)
— then compared parameter by parameter, and our measured memory and bytes per step set
beside DESIGN.md's formulas (Ψ parameters, N ranks, b bytes per element).

With strategy="optimizer" (ZeRO-1 as a whole-model transformation) the run also trains ZeRO-1
as an optimizer: DDP (``shard(strategy="none")``) + `ShardedOptimizer`, PyTorch's
ZeroRedundancyOptimizer contract, and measures its optimizer state and bytes beside it.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict
from typing import Any

import torch

from fsdp_lab import comm, reference, theory
from fsdp_lab.cluster import AttachedCluster, Cluster, device, rank, world_size
from fsdp_lab.labs import LabResult
from fsdp_lab.labs.shard_config import ShardConfig
from fsdp_lab.model_spec import check_on_rank0, load_factory
from fsdp_lab.sharding import ShardedOptimizer, shard, sharding_state
from fsdp_lab.trace import MemoryTracker, Timeline

MODEL_STATE = ("parameters", "gradients", "optimizer_state", "comm_buffers")


def _unit_classes(model: torch.nn.Module) -> tuple[type, ...]:
    """Wrap the repeated blocks (the ModuleList children), as one does for a transformer."""
    blocks = {
        type(m) for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst
    }
    return tuple(blocks)


def _optimizer_class(cfg: ShardConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    if cfg.optimizer == "adam":
        return torch.optim.Adam, {"lr": cfg.lr}
    return torch.optim.SGD, {"lr": cfg.lr, "momentum": 0.9}


def _optimizer(cfg: ShardConfig, params: Any) -> torch.optim.Optimizer:
    optimizer_class, kwargs = _optimizer_class(cfg)
    return optimizer_class(params, **kwargs)


def _timed_training(
    cfg: ShardConfig, model: torch.nn.Module, opt: Any, vocab: int
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
        vocab_size=vocab,
    )
    per_step = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    # The first step records the unit order and creates the optimizer state: leave it out.
    return losses, statistics.median(per_step[1:] if len(per_step) > 1 else per_step)


def _ours(cfg: ShardConfig, vocab: int) -> dict[str, Any]:
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
        losses, _ = _timed_training(cfg, model, opt, vocab)
    steps = log.records[at_wrap:]  # the training steps' collectives, not the wrap's
    trace = mem.trace()
    # Timed again without the tracker, whose dispatch mode and marks cost more than a step.
    timed = factory().to(device())
    shard(timed, units=set(units) or None, strategy=cfg.strategy, prefetch=cfg.prefetch)
    _, step_time = _timed_training(cfg, timed, _optimizer(cfg, timed.parameters()), vocab)
    model_state = [sum(trace["bytes"][c][i] for c in MODEL_STATE) for i in range(len(trace["t"]))]
    return {
        "losses": losses,
        "step_time_s": step_time,
        "params": reference.full_parameters(model),
        "comm_bytes_per_step": {op: b / cfg.steps for op, b in comm.bytes_by_op(steps).items()},
        "calls_per_step": {op: c / cfg.steps for op, c in comm.calls_by_op(steps).items()},
        "comm_bytes_at_wrap": comm.bytes_by_op(log.records[:at_wrap]),
        "memory_trace": trace,
        "peak_bytes": trace["peak_bytes"],
        "peak_model_state_bytes": max(model_state),
        "optimizer_state_bytes": max(trace["bytes"]["optimizer_state"]),
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


def _fsdp2(cfg: ShardConfig, vocab: int) -> dict[str, Any]:
    model = load_factory(cfg.model)().to(device())
    reference.apply_fsdp2(model, _unit_classes(model))
    opt = _optimizer(cfg, model.parameters())
    losses, step_time = _timed_training(cfg, model, opt, vocab)
    return {"losses": losses, "step_time_s": step_time, "params": reference.full_parameters(model)}


def _ddp_sharded_optimizer(cfg: ShardConfig, vocab: int) -> dict[str, Any]:
    """ZeRO-1 as an optimizer: DDP's all-reduce, then `ShardedOptimizer` steps and broadcasts."""
    factory = load_factory(cfg.model)
    optimizer_class, kwargs = _optimizer_class(cfg)
    with MemoryTracker(device(), rank=rank()) as mem:
        model = factory().to(device())
        units = _unit_classes(model)
        shard(model, units=set(units) or None, strategy="none")
        opt = ShardedOptimizer(model.parameters(), optimizer_class, **kwargs)
        mem.track(model)
        mem.track(opt)
        mem.mark("sharded")
        with comm.CommLog() as log:  # from here on: the bytes of the training steps only
            losses, _ = _timed_training(cfg, model, opt, vocab)
    trace = mem.trace()
    model_state = [sum(trace["bytes"][c][i] for c in MODEL_STATE) for i in range(len(trace["t"]))]
    owned = opt.params_per_rank
    return {
        "losses": losses,
        "params": reference.full_parameters(model),
        "optimizer_state_bytes": max(trace["bytes"]["optimizer_state"]),
        "peak_model_state_bytes": max(model_state),
        "comm_bytes_per_step": {op: b / cfg.steps for op, b in log.bytes_by_op().items()},
        "calls_per_step": {op: c / cfg.steps for op, c in log.calls_by_op().items()},
        "owned_numel_per_rank": [sum(p.numel() for p in ps) for ps in owned],
        "owned_tensors_per_rank": [len(ps) for ps in owned],
        "trainable_numel": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "element_size": next(model.parameters()).element_size(),
    }


def _ddp_zero_redundancy(cfg: ShardConfig, vocab: int) -> dict[str, torch.Tensor]:
    """PyTorch's own: DistributedDataParallel + ZeroRedundancyOptimizer, same model and data."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = reference.apply_ddp(load_factory(cfg.model)().to(device()))
    optimizer_class, kwargs = _optimizer_class(cfg)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, **kwargs)
    reference.train_steps(
        model,
        opt,
        cfg.steps,
        global_batch=cfg.global_batch,
        rank=rank(),
        world=world_size(),
        device=device(),
        vocab_size=vocab,
    )
    return reference.full_parameters(model)


def _single_process(cfg: ShardConfig, vocab: int) -> dict[str, torch.Tensor]:
    model = load_factory(cfg.model)()
    opt = _optimizer(cfg, model.parameters())
    reference.train_steps(model, opt, cfg.steps, global_batch=cfg.global_batch, vocab_size=vocab)
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


def _sharded_optimizer_data(
    config: ShardConfig,
    ours: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    pytorch: list[dict[str, torch.Tensor]] | None,
    single: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """The measured entry for DDP + ShardedOptimizer, beside strategy="optimizer"'s run."""
    first = runs[0]
    th = theory.sharded_optimizer_step(
        first["owned_numel_per_rank"],
        first["trainable_numel"],
        first["element_size"],
        config.optimizer,
        len(runs),
    )
    return {
        "max_abs_diff_vs_single_process": max_abs_diff(first["params"], single),
        "max_abs_diff_vs_zero1_transformation": max_abs_diff(first["params"], ours[0]["params"]),
        "max_abs_diff_vs_zero_redundancy_optimizer": max_abs_diff(first["params"], pytorch[0])
        if pytorch
        else None,
        "owned_numel_per_rank": first["owned_numel_per_rank"],
        "owned_tensors_per_rank": first["owned_tensors_per_rank"],
        "optimizer_state_bytes_per_rank": [r["optimizer_state_bytes"] for r in runs],
        "peak_model_state_bytes_per_rank": [r["peak_model_state_bytes"] for r in runs],
        "comm_bytes_per_rank": [r["comm_bytes_per_step"] for r in runs],
        "calls_per_step": first["calls_per_step"],
        "comm_matches_theory": all(
            _same_bytes(r["comm_bytes_per_step"], th["comm_bytes"]) for r in runs
        ),
        "theory": th,
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
        # The --model contract, on rank 0 where it trains, before anything is sharded.
        vocab = cluster.run(check_on_rank0, config.model)[0]
        ours = cluster.run(_ours, config, vocab)
        fsdp2 = cluster.run(_fsdp2, config, vocab) if config.compare_fsdp2 else None
        with_sharded_optimizer = config.strategy == "optimizer" and config.sharded_optimizer
        sharded_opt = (
            cluster.run(_ddp_sharded_optimizer, config, vocab) if with_sharded_optimizer else None
        )
        zero_redundancy = (
            cluster.run(_ddp_zero_redundancy, config, vocab)
            if with_sharded_optimizer and config.compare_fsdp2
            else None
        )
    finally:
        if owned:
            cluster.close()
    single = _single_process(config, vocab)
    precision = theory.FP32_ADAM if config.optimizer == "adam" else theory.FP32_SGD
    th = theory.sharding_step(config.strategy, ours[0]["units"], n, precision)
    data: dict[str, Any] = {
        "config": {**asdict(config), "world_size": n},
        "world_size": n,
        "strategy": config.strategy,
        "backend": cluster.backend,
        "vocab_size": vocab,  # token ids are drawn below it (model_spec.vocab_size_of's order)
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
        "optimizer_state_bytes_per_rank": [o["optimizer_state_bytes"] for o in ours],
        "sharded_optimizer": _sharded_optimizer_data(
            config, ours, sharded_opt, zero_redundancy, single
        )
        if sharded_opt
        else None,
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
    from fsdp_lab.sizes import format_bytes

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
    so = result.data.get("sharded_optimizer")
    if so:
        lines += [
            "",
            "DDP + ShardedOptimizer (ZeRO-1 as an optimizer):",
            "",
            f"- max |it - single process| = {so['max_abs_diff_vs_single_process']:.3g}",
            f"- max |it - shard(strategy='optimizer')| = "
            f"{so['max_abs_diff_vs_zero1_transformation']:.3g}",
        ]
        if so["max_abs_diff_vs_zero_redundancy_optimizer"] is not None:
            lines.append(
                f"- max |it - PyTorch's ZeroRedundancyOptimizer| = "
                f"{so['max_abs_diff_vs_zero_redundancy_optimizer']:.3g}"
            )
        share = so["theory"]["largest_share_over_even_split"]
        lines += [f"- busiest rank's share of the state / even split: {share:.3f}", ""]
        lines.append(sharded_optimizer_table(result))
    return "\n".join(lines)


def sharded_optimizer_table(result: LabResult) -> str:
    """Markdown: ZeRO-1 two ways, measured — `shard(strategy="optimizer")` and DDP +
    `ShardedOptimizer` — optimizer state per rank and bytes per step, with their formulas."""
    from fsdp_lab.sizes import format_bytes

    so = result["sharded_optimizer"]
    th = so["theory"]
    lines = [
        "| rank | elements owned (ShardedOptimizer) | optimizer state: ShardedOptimizer "
        "| formula K·Ψ_r | even split K·Ψ/N | shard(strategy='optimizer') |",
        "|---|---|---|---|---|---|",
    ]
    for r, measured in enumerate(so["optimizer_state_bytes_per_rank"]):
        lines.append(
            f"| {r} | {so['owned_numel_per_rank'][r]} | {format_bytes(measured)} "
            f"| {format_bytes(th['optimizer_state_bytes_per_rank'][r])} "
            f"| {format_bytes(th['optimizer_state_bytes_even_split'])} "
            f"| {format_bytes(result['optimizer_state_bytes_per_rank'][r])} |"
        )
    lines += [
        "",
        "| collective | shard(strategy='optimizer') | formula | DDP + ShardedOptimizer | formula |",
        "|---|---|---|---|---|",
    ]
    columns = [  # rank 0, measured and formula, for each of the two
        result["comm_bytes_per_rank"][0],
        result["theory_comm_bytes"],
        so["comm_bytes_per_rank"][0],
        th["comm_bytes"],
    ]
    for op in (*result["theory_comm_bytes"], *th["comm_bytes"]):
        cells = [format_bytes(c[op]) if op in c else "-" for c in columns]
        lines.append(f"| {op} | {' | '.join(cells)} |")
    lines.append(f"| total | {' | '.join(format_bytes(sum(c.values())) for c in columns)} |")
    lines.append(
        f"\nDDP + ShardedOptimizer bytes equal their formula on every rank: "
        f"{so['comm_matches_theory']}"
    )
    return "\n".join(lines)
