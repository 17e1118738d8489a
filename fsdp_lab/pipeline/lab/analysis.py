"""Lab 05, the verdicts: the stages against the unsplit init, against each other and against
single-process training — pure functions of what the ranks returned, testable without ranks.

[Note: what "repeats another stage's draws" means] Every stage seeded alike (``same_seed``)
reads the random stream from its start. Stage 0 spends the first draws on the embeddings, so
its layer 0 and stage 1's first layer come from *different* places of the stream: position by
position they are uncorrelated (≈ 0), yet stage 1's draws are stage 0's first draws, value for
value. Stages 1, 2, ... own no embedding: with S >= 3 their first layers are identical. So the
lab also counts, over the drawn weights (Linear and Embedding; LayerNorm ones and zero biases
draw nothing), the fraction of a later stage's values equal to a value drawn on an earlier
stage. Independent normals coincide by chance (float32 has ~2^23 values per octave: about 1e-3
of the values at these sizes); a repeated *pair* of consecutive values practically never does,
so `stages_distinct` is decided on pairs.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import torch
import torch.nn as nn

from fsdp_lab import reference, theory
from fsdp_lab.pipeline import PipeGPT, PipeGPTConfig, stage_info
from fsdp_lab.pipeline.lab import convergence
from fsdp_lab.pipeline.lab.config import LOSS_RTOL, PPSeedConfig
from fsdp_lab.pipeline.lab.timing import first_calls, growth_timing, init_costs, scaling_rows
from fsdp_lab.pipeline.rng import record_init_order, stage_of_module

SAMPLE = 256  # values per stage kept in the result for the scatter plot
Params = dict[str, torch.Tensor]


def analyse(config: PPSeedConfig, measured: dict[str, Any]) -> dict[str, Any]:
    """What the ranks returned -> the lab's JSON (parameters compared here, then dropped)."""
    config = replace(config, world_size=measured["world_size"])  # the cluster's size won
    ranks = measured["per_rank"]
    base = ranks[0]["baseline"]
    state_bytes = ranks[0]["generator_state_bytes"]
    owner_changes = handoffs(config)
    growth = [growth_row(config, i, ranks) for i in range(len(config.grow_dims))]
    strategies: dict[str, Any] = {}
    for strategy in config.strategies:
        params = [r[strategy]["params"] for r in ranks]
        first_pipeline = {
            r["stage"]: p for r, p in zip(ranks, params, strict=True) if not r["dp_rank"]
        }
        inits = [r[strategy]["init"] for r in ranks]
        row = {
            **compare_with_reference(params, base["params"]),
            **init_costs(inits),
            **loss_check(config, ranks, strategy, base["losses"]),
            "overlap": stage_overlap(config.gpt(), first_pipeline),
        }
        row["mesh"] = {
            **replica_check(params, [r["stage"] for r in ranks]),
            "stages_distinct": row["overlap"]["stages_distinct"],
        }
        if strategy == "rng_replay":
            row["theory_bytes_moved"] = theory.rng_replay_bytes(
                owner_changes, state_bytes, config.dp
            )
        if strategy == "seed_checkpoint":
            row["checkpoint_file_bytes"] = inits[0]["checkpoint_file_bytes"]
        strategies[strategy] = row
    return {
        "config": {**asdict(config), "dp": config.dp},
        "world_size": config.world_size,
        "stages": config.stages,
        "dp": config.dp,
        "backend": measured["backend"],
        "model": asdict(config.gpt()),
        "full_model_bytes": sum(v.numel() * v.element_size() for v in base["params"].values()),
        "generator_state_bytes": state_bytes,
        "handoffs": owner_changes,
        "layers_per_stage": [
            list(stage_info(s, config.stages, config.stages, config.layers).layers)
            for s in range(config.stages)
        ],
        "strategies": strategies,
        "baseline": {"losses": base["losses"], "final_loss": base["losses"][-1]},
        "growth": growth,
        "growth_timing": growth_timing(config, growth) if growth else None,
        "first_call": first_calls(ranks, strategies),
        "cores": measured.get("cores"),
        "repeats": config.repeats,
        "scaling": _scaling(config, measured),
        "convergence": _convergence(config, measured.get("convergence") or []),
    }


def _scaling(config: PPSeedConfig, measured: dict[str, Any]) -> dict[str, Any] | None:
    """The init timed on 1, 2, ... ranks (`timing.scaling_rows`), with the model's size."""
    if not measured.get("scaling"):
        return None
    rows = scaling_rows(config, measured["scaling"], measured.get("cores"))
    return rows | {"full_model_bytes": model_bytes(config, config.scale_width)}


def _convergence(config: PPSeedConfig, trained: list[Any]) -> dict[str, Any] | None:
    """The convergence trainings, (seed, init, losses) in any order -> `convergence.compare`."""
    if not trained:
        return None
    curves: dict[str, dict[int, list[float]]] = {init: {} for init in convergence.INITS}
    for seed, init, losses in trained:
        curves[init][seed] = losses
    return convergence.compare(config, curves)


def handoffs(config: PPSeedConfig) -> int:
    """Changes of owner along the recorded init order: the messages of RNG replay."""
    stage_of = stage_of_module(config.gpt(), config.stages, None)
    with torch.device("meta"):
        owners = [stage_of(name) for name in record_init_order(PipeGPT(config.gpt()))]
    return sum(a != b for a, b in zip(owners, owners[1:], strict=False))


def model_bytes(config: PPSeedConfig, dim: int) -> int:
    """The whole model's fp32 bytes at width `dim` (counted on meta: nothing allocated)."""
    with torch.device("meta"):
        return 4 * sum(p.numel() for p in PipeGPT(config.gpt(dim)).parameters())


def growth_row(config: PPSeedConfig, i: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Width ``grow_dims[i]``: whole-model bytes, and per strategy each rank's init costs."""
    dim = config.grow_dims[i]
    full = model_bytes(config, dim)
    row: dict[str, Any] = {"dim": dim, "parameters": full // 4, "full_model_bytes": full}
    for strategy in config.strategies:
        costs = init_costs([r["growth"][i][strategy] for r in ranks])
        row[strategy] = {k: costs[k] for k in _GROWTH_KEYS}
    return row


_GROWTH_KEYS = ("peak_bytes_per_rank", "init_time_s", "init_time_s_runs", "init_time_s_per_rank")
_GROWTH_KEYS += ("cpu_time_s_per_rank", "cpu_time_s_runs", "bytes_moved")


def compare_with_reference(params: list[Params], ref: Params) -> dict[str, Any]:
    """Every rank's stage against the unsplit init: bitwise equal?, the largest |difference|.

    The difference is taken in float32 (`reference.max_abs_diff`): it is 0 exactly when the
    values are equal, and exact besides whenever the two are within a factor 2 of each other.
    """
    held = set().union(*params)
    if held != set(ref):
        raise ValueError(f"the stages do not hold the whole model: {sorted(held ^ set(ref))}")
    mismatched = sorted({k for p in params for k, v in p.items() if not torch.equal(v, ref[k])})
    return {
        "bitwise_equal": not mismatched,
        "max_abs_diff": max(reference.max_abs_diff(p, {k: ref[k] for k in p}) for p in params),
        "mismatched_parameters": len(mismatched),
        "first_mismatched": mismatched[:3],
    }


def loss_check(
    config: PPSeedConfig, ranks: list[dict[str, Any]], strategy: str, baseline: list[float]
) -> dict[str, Any]:
    """Mean over the pipelines of their last stage's losses, against single-process training."""
    curves = [r[strategy]["losses"] for r in ranks if r["stage"] == config.stages - 1]
    losses = [sum(step) / len(step) for step in zip(*curves, strict=True)]
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, baseline, strict=True)]
    return {
        "losses": losses,
        "final_loss": losses[-1],
        "loss_max_rel_diff": max(rel),
        "loss_matches_baseline": max(rel) <= LOSS_RTOL,
    }


def replica_check(params: list[Params], stage_of: list[int]) -> dict[str, Any]:
    """pp x dp: do the replicas of each stage (one per pipeline) hold identical weights?"""
    by_stage: dict[int, list[Params]] = {}
    for p, s in zip(params, stage_of, strict=True):
        by_stage.setdefault(s, []).append(p)
    pairs = [(first, other) for first, *others in by_stage.values() for other in others]
    if not pairs:  # dp = 1: one replica per stage, nothing to compare
        return {"replicas_equal": None, "replica_max_abs_diff": None}
    return {
        "replicas_equal": all(torch.equal(a[k], b[k]) for a, b in pairs for k in a),
        "replica_max_abs_diff": max(reference.max_abs_diff(a, b) for a, b in pairs),
    }


# -- how much the stages repeat each other ------------------------------------------------------


def drawn_weights(model_config: PipeGPTConfig) -> list[str]:
    """Names of the weights `init_weights` fills with random values, in the order it draws."""
    with torch.device("meta"):
        model = PipeGPT(model_config)
    return [
        f"{name}.weight"
        for name, module in model.init_modules()
        if isinstance(module, (nn.Linear, nn.Embedding))
    ]


def _stream(params: Params, names: list[str], prefix: str = "") -> torch.Tensor:
    """The stage's drawn values, flattened and concatenated in drawing order."""
    parts = [params[n].flatten() for n in names if n in params and n.startswith(prefix)]
    return torch.cat(parts).float()


def _first_layer(params: Params) -> int:
    return min(int(k.split(".")[1]) for k in params if k.startswith("layers."))


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1].item()


def _pairs(x: torch.Tensor) -> torch.Tensor:
    """Each two consecutive values as one int64 (their float32 bit patterns side by side)."""
    bits = x.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    return (bits[:-1] << 32) | bits[1:]


def _fraction_in(values: torch.Tensor, earlier: torch.Tensor) -> float:
    return torch.isin(values, earlier).double().mean().item()


def _shared_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many values `a` and `b` share from their first on."""
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


def stage_overlap(model_config: PipeGPTConfig, stage_params: dict[int, Params]) -> dict[str, Any]:
    """How the stages' drawn values relate (one pipeline; see the [Note] above). With one stage
    there is nothing to compare: the figures are None.

    Args:
        model_config: the model the stages came from.
        stage_params: stage -> its parameters (initial values), stages 0 .. S-1.
    """
    names = drawn_weights(model_config)
    stages = sorted(stage_params)
    streams = [_stream(stage_params[s], names) for s in stages]
    first = [
        _stream(stage_params[s], names, f"layers.{_first_layer(stage_params[s])}.") for s in stages
    ]
    later = stages[1:]
    values = [None] + [_fraction_in(streams[s], torch.cat(streams[:s])) for s in later]
    pairs = [None] + [
        _fraction_in(_pairs(streams[s]), _pairs(torch.cat(streams[:s]))) for s in later
    ]
    samples = {}
    if later:  # stage 1's first values against stage 0's, for the scatter plot
        samples = {
            "stage0_stream": streams[0][:SAMPLE].tolist(),
            "stage1_stream": streams[1][:SAMPLE].tolist(),
            "stage0_first_layer": first[0][:SAMPLE].tolist(),
            "stage1_first_layer": first[1][:SAMPLE].tolist(),
        }
    return {
        "first_layer_corr_0_1": _corr(first[0], first[1]) if later else None,
        "first_layer_corr_1_2": _corr(first[1], first[2]) if len(stages) >= 3 else None,
        "shared_prefix_values_0_1": _shared_prefix(streams[0], streams[1]) if later else None,
        "identical_first_layers": [
            [a, b] for a in stages for b in stages if a < b and torch.equal(first[a], first[b])
        ],
        "duplicate_fraction_per_stage": values,
        "duplicate_fraction": max(values[1:]) if later else None,
        # Independent draws share single values by chance, pairs practically never: see the Note.
        "repeated_pair_fraction_per_stage": pairs,
        "stages_distinct": max(pairs[1:]) == 0.0 if later else None,
        "samples": samples,
    }
