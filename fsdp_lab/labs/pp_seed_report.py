"""Lab 05's comparisons and pictures: the stages against the unsplit init, against each other
and against single-process training — pure functions of what the ranks returned.

[Note: what "repeats another stage's draws" means] Every stage seeded alike (``same_seed``)
reads the random stream from its start. Stage 0 spends the first draws on the embeddings, so
its layer 0 and stage 1's first layer sit at *different* places of the stream: compared
position by position they are uncorrelated (≈ 0), and yet stage 1's first draws are stage 0's
first draws, value for value (its first qkv weight, flattened, starts with stage 0's token
embedding). Stages 1, 2, ... own no embedding and all start their first layer at the stream's
start: with S >= 3 their first layers are identical (correlation 1.0). So a correlation of
aligned layers says little; the lab also counts, over the flattened drawn weights (Linear and
Embedding weights — LayerNorm ones and zero biases draw nothing), the fraction of a later
stage's values that equal, as floats, a value drawn on an earlier stage. Independent normals
coincide only by chance (float32 has ~2^23 values per octave: about 1e-3 of the values at
these sizes, growing with the size); a repeated *pair* of consecutive values practically never
does, so `stages_distinct` is decided on pairs.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
import torch.nn as nn

from fsdp_lab import theory
from fsdp_lab.labs import LabResult
from fsdp_lab.labs.pp_seed_config import PPSeedConfig
from fsdp_lab.pipeline import PipeGPT, PipeGPTConfig, stage_info
from fsdp_lab.pipeline.rng import record_init_order, stage_of_module

LOSS_RTOL = 1e-5  # "within float rounding": GPipe sums M micro-batch losses in another order
LETTERS = {"seed_checkpoint": "a", "same_seed": "b", "per_stage_seed": "c", "rng_replay": "d"}
SAMPLE = 256  # values per stage kept in the result for the scatter plot


def handoffs(config: PPSeedConfig) -> int:
    """Changes of owner along the recorded init order: the messages of RNG replay."""
    stage_of = stage_of_module(config.gpt(), config.stages, None)
    with torch.device("meta"):
        owners = [stage_of(name) for name in record_init_order(PipeGPT(config.gpt()))]
    return sum(a != b for a, b in zip(owners, owners[1:], strict=False))


def analyse(
    config: PPSeedConfig,
    ranks: list[dict[str, Any]],
    growth: list[list[dict[str, Any]]],
    base: dict[str, Any],
    backend: str,
) -> dict[str, Any]:
    """What the ranks returned -> the lab's JSON (parameters compared here, then dropped)."""
    state_bytes = ranks[0]["generator_state_bytes"]
    theory_handoffs = handoffs(config)
    full_bytes = sum(v.numel() * v.element_size() for v in base["params"].values())
    strategies: dict[str, Any] = {}
    for strategy in config.strategies:
        per_rank = [r[strategy] for r in ranks]
        params = [p["params"] for p in per_rank]
        first_pipeline = {
            r["stage"]: p for r, p in zip(ranks, params, strict=True) if not r["dp_rank"]
        }
        inits = [p["init"] for p in per_rank]
        row = {
            **compare_with_reference(params, base["params"]),
            "peak_bytes_per_rank": [i["peak_bytes"] for i in inits],
            "init_time_s": max(i["init_time_s"] for i in inits),
            "init_time_s_per_rank": [i["init_time_s"] for i in inits],
            "bytes_moved": int(sum(i["bytes_moved"] for i in inits)),  # whole bytes, as floats
            "bytes_moved_per_rank": [int(i["bytes_moved"]) for i in inits],
            "messages": sum(i["messages"] for i in inits),
            **loss_check(config, ranks, strategy, base["losses"]),
        }
        row["overlap"] = stage_overlap(config.gpt(), first_pipeline)
        row["mesh"] = {
            **replica_check(params, [r["stage"] for r in ranks]),
            "stages_distinct": row["overlap"]["stages_distinct"],
        }
        if strategy == "rng_replay":
            row["theory_bytes_moved"] = theory.rng_replay_bytes(
                theory_handoffs, state_bytes, config.dp
            )
        if strategy == "seed_checkpoint":
            row["checkpoint_file_bytes"] = inits[0]["checkpoint_file_bytes"]
        strategies[strategy] = row
    return {
        "config": {**asdict(config), "dp": config.dp},
        "world_size": config.world_size,
        "stages": config.stages,
        "dp": config.dp,
        "backend": backend,
        "model": asdict(config.gpt()),
        "full_model_bytes": full_bytes,
        "generator_state_bytes": state_bytes,
        "handoffs": theory_handoffs,
        "layers_per_stage": [
            list(stage_info(s, config.stages, config.stages, config.layers).layers)
            for s in range(config.stages)
        ],
        "strategies": strategies,
        "baseline": {"losses": base["losses"], "final_loss": base["losses"][-1]},
        "growth": _growth_rows(config, growth),
    }


def _growth_rows(config: PPSeedConfig, growth: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per width: full model bytes, and per strategy the peak bytes and init time per rank."""
    rows = []
    for i, dim in enumerate(config.grow_dims):
        with torch.device("meta"):
            n = sum(p.numel() for p in PipeGPT(config.gpt(dim)).parameters())
        row: dict[str, Any] = {"dim": dim, "parameters": n, "full_model_bytes": 4 * n}
        for strategy in config.strategies:
            reports = [g[i][strategy] for g in growth]
            row[strategy] = {
                "peak_bytes_per_rank": [r["peak_bytes"] for r in reports],
                "init_time_s_per_rank": [r["init_time_s"] for r in reports],
                "bytes_moved": int(sum(r["bytes_moved"] for r in reports)),
            }
        rows.append(row)
    return rows


def compare_with_reference(
    params: list[dict[str, torch.Tensor]], ref: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Every rank's stage against the unsplit init: bitwise equal?, the largest |difference|."""
    held = set().union(*params)
    if held != set(ref):
        raise ValueError(f"the stages do not hold the whole model: {sorted(held ^ set(ref))}")
    mismatched = sorted({k for p in params for k, v in p.items() if not torch.equal(v, ref[k])})
    diff = max(
        (v.double() - ref[k].double()).abs().max().item() for p in params for k, v in p.items()
    )
    return {
        "bitwise_equal": not mismatched,
        "max_abs_diff": diff,
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


def replica_check(params: list[dict[str, torch.Tensor]], stage_of: list[int]) -> dict[str, Any]:
    """pp x dp: do the replicas of each stage (one per pipeline) hold identical weights?"""
    by_stage: dict[int, list[dict[str, torch.Tensor]]] = {}
    for p, s in zip(params, stage_of, strict=True):
        by_stage.setdefault(s, []).append(p)
    pairs = [(r[0][k], o[k]) for r in by_stage.values() for o in r[1:] for k in r[0]]
    if not pairs:  # dp = 1: one replica per stage, nothing to compare
        return {"replicas_equal": None, "replica_max_abs_diff": None}
    return {
        "replicas_equal": all(torch.equal(a, b) for a, b in pairs),
        "replica_max_abs_diff": max((a.double() - b.double()).abs().max().item() for a, b in pairs),
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


def _stream(params: dict[str, torch.Tensor], names: list[str], prefix: str = "") -> torch.Tensor:
    parts = [params[n].flatten() for n in names if n in params and n.startswith(prefix)]
    return torch.cat(parts).float()


def _first_layer(params: dict[str, torch.Tensor]) -> int:
    return min(int(k.split(".")[1]) for k in params if k.startswith("layers."))


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1].item()


def _pairs(x: torch.Tensor) -> torch.Tensor:
    """Each two consecutive values as one int64 (their float32 bit patterns side by side)."""
    bits = x.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    return (bits[:-1] << 32) | bits[1:]


def stage_overlap(
    model_config: PipeGPTConfig, stage_params: dict[int, dict[str, torch.Tensor]]
) -> dict[str, Any]:
    """How the stages' drawn values relate (one pipeline; see the [Note] above).

    Args:
        model_config: the model the stages came from.
        stage_params: stage -> its parameters (initial values).
    """
    names = drawn_weights(model_config)
    stages = sorted(stage_params)
    streams = [_stream(stage_params[s], names) for s in stages]
    first = [
        _stream(stage_params[s], names, f"layers.{_first_layer(stage_params[s])}.") for s in stages
    ]
    keys = ("first_layer_corr_0_1", "first_layer_corr_1_2", "shared_prefix_values_0_1")
    out: dict[str, Any] = dict.fromkeys((*keys, "duplicate_fraction", "stages_distinct"))
    out |= {"identical_first_layers": [], "samples": {}}
    out["duplicate_fraction_per_stage"] = [None] * len(stages)
    out["repeated_pair_fraction_per_stage"] = [None] * len(stages)
    if len(stages) < 2:
        return out
    out["first_layer_corr_0_1"] = _corr(first[0], first[1])
    if len(stages) >= 3:
        out["first_layer_corr_1_2"] = _corr(first[1], first[2])
    out["identical_first_layers"] = [
        [a, b] for a in stages for b in stages if a < b and torch.equal(first[a], first[b])
    ]
    n = min(len(streams[0]), len(streams[1]))
    differ = (streams[0][:n] != streams[1][:n]).nonzero()
    out["shared_prefix_values_0_1"] = int(differ[0]) if len(differ) else n
    for s in stages[1:]:
        earlier = torch.cat(streams[:s])
        out["duplicate_fraction_per_stage"][s] = (
            torch.isin(streams[s], earlier).double().mean().item()
        )
        out["repeated_pair_fraction_per_stage"][s] = (
            torch.isin(_pairs(streams[s]), _pairs(earlier)).double().mean().item()
        )
    out["duplicate_fraction"] = max(out["duplicate_fraction_per_stage"][1:])
    out["stages_distinct"] = max(out["repeated_pair_fraction_per_stage"][1:]) == 0.0
    out["samples"] = {
        "stage0_stream": streams[0][:SAMPLE].tolist(),
        "stage1_stream": streams[1][:SAMPLE].tolist(),
        "stage0_first_layer": first[0][:SAMPLE].tolist(),
        "stage1_first_layer": first[1][:SAMPLE].tolist(),
    }
    return out


# -- pictures and words -------------------------------------------------------------------------


def figures(result: LabResult) -> dict[str, Any]:
    """The ownership / RNG-travel diagram per strategy, loss curves, growth, the same-seed bug."""
    from fsdp_lab.diagrams import pipeline_diagram

    model_config = PipeGPTConfig(**result["model"])
    figs: dict[str, Any] = {
        f"pipeline_{s}": pipeline_diagram(
            model_config, result["stages"], strategy=s, dp=result["dp"]
        )
        for s in result["strategies"]
    }
    figs["loss_curves"] = loss_figure(result)
    if result["growth"]:
        figs["growth"] = growth_figure(result)
    same = result["strategies"].get("same_seed")
    if same is not None and same["overlap"]["samples"]:
        figs["same_seed_draws"] = same_seed_figure(result)
    return figs


def _label(strategy: str) -> str:
    return f"({LETTERS[strategy]}) {strategy}"


def loss_figure(result: LabResult) -> Any:
    """Loss per step of every initialised pipeline beside single-process training, and the
    relative difference from it (log scale; an exact match is drawn at the floor)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    base = result["baseline"]["losses"]
    steps = range(1, len(base) + 1)
    left.plot(steps, base, color="black", lw=4, alpha=0.3, label="unsplit baseline (1 process)")
    floor = 1e-10
    for strategy, row in result["strategies"].items():
        style = "--" if row["bitwise_equal"] else "-"
        left.plot(steps, row["losses"], style, lw=1.3, label=_label(strategy))
        rel = [max(abs(a - b) / abs(b), floor) for a, b in zip(row["losses"], base, strict=True)]
        right.plot(steps, rel, style, lw=1.3, label=_label(strategy))
    right.axhline(LOSS_RTOL, color="grey", lw=0.8, ls=":")
    right.text(1, LOSS_RTOL * 1.5, f"rtol {LOSS_RTOL:g}", fontsize=8, color="grey")
    right.set_yscale("log")
    right.set_ylim(floor / 2, None)
    left.set(xlabel="step", ylabel="loss", title="loss: pipelines vs the unsplit baseline")
    right.set(
        xlabel="step",
        ylabel="|loss - baseline| / baseline",
        title=f"relative difference ({floor:g} = exactly equal)",
    )
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    return fig


def growth_figure(result: LabResult) -> Any:
    """Peak bytes during init on rank 0 and on the other ranks as the model grows, and time."""
    from matplotlib.figure import Figure

    rows = result["growth"]
    mib = [r["full_model_bytes"] / 2**20 for r in rows]
    fig = Figure(figsize=(12, 4), layout="constrained")
    mem, tim = fig.subplots(1, 2)
    mem.plot(mib, mib, color="black", lw=4, alpha=0.2, label="the whole model")
    for i, strategy in enumerate(result["strategies"]):
        color = f"C{i}"
        rank0 = [r[strategy]["peak_bytes_per_rank"][0] / 2**20 for r in rows]
        mem.plot(mib, rank0, "o-", color=color, label=f"{_label(strategy)}, rank 0")
        if result["world_size"] > 1:
            others = [max(r[strategy]["peak_bytes_per_rank"][1:]) / 2**20 for r in rows]
            mem.plot(mib, others, "x--", color=color, label=f"{_label(strategy)}, other ranks")
        seconds = [max(r[strategy]["init_time_s_per_rank"]) for r in rows]
        tim.plot(mib, seconds, "o-", color=color, label=_label(strategy))
    dims = ", ".join(str(r["dim"]) for r in rows)
    mem.set(
        xlabel="whole model (MiB fp32)",
        ylabel="peak during init (MiB)",
        title=f"init peak per rank, dim {dims}, L = {result['model']['n_layers']}",
    )
    tim.set(
        xlabel="whole model (MiB fp32)", ylabel="init time, slowest rank (s)", title="init time"
    )
    mem.legend(fontsize=7)
    tim.legend(fontsize=8)
    return fig


def same_seed_figure(result: LabResult) -> Any:
    """(b): stage 1's draws against stage 0's — at aligned layers, and in drawing order."""
    from matplotlib.figure import Figure

    over = result["strategies"]["same_seed"]["overlap"]
    sample = over["samples"]
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    aligned, ordered = fig.subplots(1, 2)
    aligned.scatter(sample["stage0_first_layer"], sample["stage1_first_layer"], s=6)
    aligned.set(
        xlabel="stage 0, layer 0 (first values)",
        ylabel="stage 1, its first layer (first values)",
        title=f"aligned positions: corr {over['first_layer_corr_0_1']:.3f}",
    )
    ordered.scatter(sample["stage0_stream"], sample["stage1_stream"], s=6, color="C3")
    ordered.set(
        xlabel="stage 0's k-th drawn value (tok_emb first)",
        ylabel="stage 1's k-th drawn value",
        title=f"in drawing order: the first {over['shared_prefix_values_0_1']:,} are equal",
    )
    fig.suptitle("(b) same_seed: every stage reads the random stream from its start", fontsize=11)
    return fig


def results_table(result: LabResult) -> str:
    """One Markdown row per strategy: what the issue asks, measured."""
    from fsdp_lab.sizes import format_bytes

    lines = [
        "| strategy | bitwise = unsplit | max abs diff | peak rank 0 | peak other ranks "
        "| init time | bytes moved | messages | final loss | loss = baseline |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for strategy, row in result["strategies"].items():
        peaks = row["peak_bytes_per_rank"]
        others = format_bytes(max(peaks[1:])) if len(peaks) > 1 else "-"
        lines.append(
            f"| {_label(strategy)} | {'yes' if row['bitwise_equal'] else 'no'} "
            f"| {row['max_abs_diff']:.3g} | {format_bytes(peaks[0])} | {others} "
            f"| {row['init_time_s'] * 1e3:.1f} ms | {row['bytes_moved']:,.0f} B | {row['messages']} "
            f"| {row['final_loss']:.4f} | {'yes' if row['loss_matches_baseline'] else 'no'} "
            f"(max rel diff {row['loss_max_rel_diff']:.1e}) |"
        )
    return "\n".join(lines)


def overlap_table(result: LabResult) -> str:
    """Per strategy: how much the stages repeat each other's draws."""

    def num(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        "| strategy | corr(stage 0 layer 0, stage 1 first layer) | corr(stage 1, stage 2 first "
        "layers) | identical first layers | shared prefix, stages 0/1 | values repeating an "
        "earlier stage's | stages distinct | replicas equal (dp) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for strategy, row in result["strategies"].items():
        o, mesh = row["overlap"], row["mesh"]
        same = ", ".join(f"{a}={b}" for a, b in o["identical_first_layers"]) or "none"
        fractions = ", ".join(num(f, ".2e") for f in o["duplicate_fraction_per_stage"][1:]) or "-"
        lines.append(
            f"| {_label(strategy)} | {num(o['first_layer_corr_0_1'], '.3f')} "
            f"| {num(o['first_layer_corr_1_2'], '.3f')} | {same} "
            f"| {num(o['shared_prefix_values_0_1'], ',')} | {fractions} "
            f"| {num(o['stages_distinct'], '')} | {num(mesh['replicas_equal'], '')} |"
        )
    return "\n".join(lines)


def summary(result: LabResult) -> str:
    from fsdp_lab.sizes import format_bytes

    r = result
    lines = [
        f"pipeline seeding: S = {r['stages']} stages x dp = {r['dp']} on {r['world_size']} ranks "
        f"({r['backend']}); layers per stage {r['layers_per_stage']}; whole model "
        f"{format_bytes(r['full_model_bytes'])}; generator state {r['generator_state_bytes']} B, "
        f"{r['handoffs']} handoff(s) per pipeline",
        "",
        results_table(r),
        "",
        overlap_table(r),
    ]
    if r["growth"]:  # per width: rank 0's peak / the other ranks' highest, slowest init
        head = " | ".join(f"{_label(s)} peak rank 0 / others, time" for s in r["strategies"])
        lines += [
            "",
            f"| dim | whole model | {head} |",
            "|---|---|" + "---|" * len(r["strategies"]),
        ]
        for row in r["growth"]:
            cells = []
            for s in r["strategies"]:
                peaks = row[s]["peak_bytes_per_rank"]
                others = format_bytes(max(peaks[1:])) if len(peaks) > 1 else "-"
                seconds = max(row[s]["init_time_s_per_rank"])
                cells.append(f"{format_bytes(peaks[0])} / {others}, {seconds * 1e3:.1f} ms")
            lines.append(
                f"| {row['dim']} | {format_bytes(row['full_model_bytes'])} | "
                + " | ".join(cells)
                + " |"
            )
    return "\n".join(lines)
