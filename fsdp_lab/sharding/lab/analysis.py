"""Lab 01, the verdicts: does ours train like one process and like FSDP2, and do its measured
memory and bytes per step equal the formulas of `fsdp_lab.theory` (`sharding_step`)?

Pure functions of what `measure.py` brought back; no rank is needed to run or test them.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from fsdp_lab import theory
from fsdp_lab.reference import max_abs_diff
from fsdp_lab.sharding.lab.config import ShardConfig
from fsdp_lab.trace.memory import MODEL_STATE

# What the ZeRO formulas count: the gathered unit's buffer is a comm buffer; activations are not
# model state (activation checkpointing, lab 02, is about those).


def model_state_bytes(trace: dict[str, Any]) -> list[int]:
    """The model state at every sample of a `MemoryTracker` trace."""
    return [sum(trace["bytes"][c][i] for c in MODEL_STATE) for i in range(len(trace["t"]))]


def same_bytes(measured: dict[str, float], formula: dict[str, float]) -> bool:
    """Measured bytes per collective equal the formula's, collective by collective."""
    # Equal up to float rounding of the (N-1)/N factor summed over units and steps; a
    # collective one side lacks is 0 bytes there (one rank sends none of them).
    return all(
        math.isclose(measured.get(k, 0.0), formula.get(k, 0.0), rel_tol=1e-12)
        for k in {*measured, *formula}
    )


def _per_rank(runs: list[dict[str, Any]], formula: dict[str, float]) -> dict[str, Any]:
    """What every rank of a run measured: its optimizer state, model-state peak and bytes per
    step, and whether those bytes equal the `formula` on every rank."""
    traces = [r["memory_trace"] for r in runs]
    return {
        "optimizer_state_bytes_per_rank": [max(t["bytes"]["optimizer_state"]) for t in traces],
        "peak_model_state_bytes_per_rank": [max(model_state_bytes(t)) for t in traces],
        "comm_bytes_per_rank": [r["comm_bytes_per_step"] for r in runs],
        "comm_matches_theory": all(same_bytes(r["comm_bytes_per_step"], formula) for r in runs),
    }


def _sharded_optimizer(config: ShardConfig, measured: dict[str, Any]) -> dict[str, Any]:
    """DDP + ShardedOptimizer, beside strategy="optimizer"'s run (ZeRO-1 as a transformation)."""
    runs, pytorch = measured["sharded_optimizer"], measured["zero_redundancy"]
    first = runs[0]
    th = theory.sharded_optimizer_step(
        first["owned_numel_per_rank"],
        first["trainable_numel"],
        first["element_size"],
        config.optimizer,
        len(runs),
    )
    params = first["params"]
    return {
        "max_abs_diff_vs_single_process": max_abs_diff(params, measured["single_process"]),
        "max_abs_diff_vs_zero1_transformation": max_abs_diff(params, measured["ours"][0]["params"]),
        "max_abs_diff_vs_zero_redundancy_optimizer": max_abs_diff(params, pytorch[0])
        if pytorch
        else None,
        "owned_numel_per_rank": first["owned_numel_per_rank"],
        "owned_tensors_per_rank": first["owned_tensors_per_rank"],
        **_per_rank(runs, th["comm_bytes"]),
        "calls_per_step": first["calls_per_step"],
        "theory": th,
    }


def analyse(config: ShardConfig, measured: dict[str, Any]) -> dict[str, Any]:
    """The runs' raw results -> the lab's result (JSON types only)."""
    n, ours, fsdp2 = measured["world_size"], measured["ours"], measured["fsdp2"]
    single, params = measured["single_process"], ours[0]["params"]
    precision = theory.FP32_ADAM if config.optimizer == "adam" else theory.FP32_SGD
    th = theory.sharding_step(config.strategy, ours[0]["units"], n, precision)
    return {
        "config": {**asdict(config), "world_size": n},
        "world_size": n,
        "strategy": config.strategy,
        "backend": measured["backend"],
        # token ids are drawn below it (model_spec.vocab_size_of's order)
        "vocab_size": measured["vocab_size"],
        "max_abs_diff_vs_single_process": max_abs_diff(params, single),
        "max_abs_diff_vs_fsdp2": max_abs_diff(params, fsdp2[0]["params"]) if fsdp2 else None,
        "fsdp2_max_abs_diff_vs_single_process": max_abs_diff(fsdp2[0]["params"], single)
        if fsdp2
        else None,
        "peak_bytes_per_rank": [o["memory_trace"]["peak_bytes"] for o in ours],
        "theory_peak_bytes": th["peak_model_state_bytes"],
        "theory_comm_bytes": th["comm_bytes"],
        "theory_comm_bytes_unpadded": th["comm_bytes_unpadded"],
        **_per_rank(ours, th["comm_bytes"]),
        "calls_per_step": ours[0]["calls_per_step"],
        "theory": th,
        "units": ours[0]["units"],
        "losses_per_rank": [o["losses"] for o in ours],
        # The slowest rank sets the pace of a step.
        "step_time_s": max(o["step_time_s"] for o in ours),
        "fsdp2_step_time_s": max(f["step_time_s"] for f in fsdp2) if fsdp2 else None,
        "memory_traces": [o["memory_trace"] for o in ours],
        "timelines": [o["timeline"] for o in ours],
        "sharded_optimizer": _sharded_optimizer(config, measured)
        if measured["sharded_optimizer"]
        else None,
    }
