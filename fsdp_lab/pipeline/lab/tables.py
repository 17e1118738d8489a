"""Lab 05's Markdown tables, for the notebook, the CLI's summary and the README: who owns what,
the strategies side by side, the stages' overlap, growth, scaling over ranks, convergence."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.markdown import table
from fsdp_lab.pipeline.lab.analysis import LOSS_RTOL
from fsdp_lab.pipeline.lab.pictures import label
from fsdp_lab.sizes import format_bytes

YES = {True: "yes", False: "no", None: "-"}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def peaks(peaks: list[int]) -> tuple[str, str]:
    """Rank 0's peak, and the highest of the other ranks' ("-" on one rank)."""
    return format_bytes(peaks[0]), format_bytes(max(peaks[1:])) if len(peaks) > 1 else "-"


def stage_table(model_config: Any, stages: int) -> str:
    """Which modules each stage (rank, in one pipeline) owns."""
    from fsdp_lab.pipeline import stage_module_names  # torch: only when asked

    return table(
        ["stage", "rank", "modules"],
        ([s, s, ", ".join(stage_module_names(model_config, s, stages))] for s in range(stages)),
    )


def results_table(result: LabResult) -> str:
    """One Markdown row per strategy: equal to the unsplit init?, memory, time, bytes, loss."""
    head = ["strategy", "bitwise = unsplit", "max abs diff", "peak rank 0", "peak other ranks"]
    head += ["init time (median)", "bytes moved", "messages", "final loss", "loss = baseline"]
    return table(
        head,
        (
            [label(s), YES[row["bitwise_equal"]], f"{row['max_abs_diff']:.3g}"]
            + [*peaks(row["peak_bytes_per_rank"]), ms(row["init_time_s"])]
            + [f"{row['bytes_moved']:,.0f} B", row["messages"], f"{row['final_loss']:.4f}"]
            + [f"{YES[row['loss_matches_baseline']]} (max rel diff {row['loss_max_rel_diff']:.1e})"]
            for s, row in result["strategies"].items()
        ),
    )


def overlap_table(result: LabResult) -> str:
    """Per strategy: how much the stages repeat each other's draws, and whether replicas agree."""

    def num(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    head = ["strategy", "corr(stage 0 layer 0, stage 1 first layer)"]
    head += ["corr(stage 1, stage 2 first layers)", "identical first layers"]
    head += ["shared prefix, stages 0/1", "values repeating an earlier stage's"]
    head += ["stages distinct", "replicas equal (dp)"]
    rows = []
    for strategy, row in result["strategies"].items():
        o, mesh = row["overlap"], row["mesh"]
        same = ", ".join(f"{a}={b}" for a, b in o["identical_first_layers"]) or "none"
        fractions = ", ".join(num(f, ".2e") for f in o["duplicate_fraction_per_stage"][1:]) or "-"
        rows.append(
            [label(strategy), num(o["first_layer_corr_0_1"], ".3f")]
            + [num(o["first_layer_corr_1_2"], ".3f"), same]
            + [num(o["shared_prefix_values_0_1"], ","), fractions]
            + [num(o["stages_distinct"], ""), num(mesh["replicas_equal"], "")]
        )
    return table(head, rows)


def loss_table(result: LabResult) -> str:
    """Per strategy: final loss beside single-process training's, and the largest gap."""
    base = result["baseline"]["final_loss"]
    return table(
        ["strategy", "final loss", "single process", "max rel diff", f"within rtol {LOSS_RTOL:g}"],
        (
            [label(s), f"{row['final_loss']:.5f}", f"{base:.5f}"]
            + [f"{row['loss_max_rel_diff']:.1e}", YES[row["loss_matches_baseline"]]]
            for s, row in result["strategies"].items()
        ),
    )


def mesh_table(result: LabResult) -> str:
    """pp x dp: per strategy, replicas equal?, stages distinct?, the unsplit init?, bytes."""
    return table(
        ["strategy", "replicas equal", "stages distinct", "bitwise = unsplit", "bytes moved"]
        + ["loss = baseline"],
        (
            [label(s), YES[row["mesh"]["replicas_equal"]], YES[row["mesh"]["stages_distinct"]]]
            + [YES[row["bitwise_equal"]], f"{row['bytes_moved']:,} B"]
            + [YES[row["loss_matches_baseline"]]]
            for s, row in result["strategies"].items()
        ),
    )


def growth_table(result: LabResult) -> str:
    """Per width: the whole model, and per strategy rank 0's peak / the others', the median
    init time of the pipeline."""
    strategies = list(result["strategies"])
    head = ["dim", "whole model"] + [f"{label(s)} peak rank 0 / others, time" for s in strategies]

    def cell(r: dict[str, Any]) -> str:
        rank0, others = peaks(r["peak_bytes_per_rank"])
        return f"{rank0} / {others}, {ms(r['init_time_s'])}"

    return table(
        head,
        (
            [row["dim"], format_bytes(row["full_model_bytes"])] + [cell(row[s]) for s in strategies]
            for row in result["growth"]
        ),
    )


def scaling_table(result: LabResult) -> str:
    """Per rank count: each strategy's pipeline init time and its busiest rank's CPU time."""
    strategies = result["scaling"]["strategies"]
    head = ["ranks"] + [f"{label(s)} wall / CPU" for s in strategies]

    def cell(costs: dict[str, Any]) -> str:
        return f"{ms(costs['init_time_s'])} / {ms(max(costs['cpu_time_s_per_rank']))}"

    return table(
        head,
        ([row["ranks"]] + [cell(row[s]) for s in strategies] for row in result["scaling"]["rows"]),
    )


def convergence_table(result: LabResult) -> str:
    """Per seed: the final loss from the unsplit and from the same-seed init, and their gap."""
    conv = result["convergence"]
    rows: Iterable[list[Any]] = (
        [seed, f"{a:.4f}", f"{b:.4f}", f"{b - a:+.4f}"]
        for seed, a, b in zip(
            conv["seeds"], conv["final"]["unsplit"], conv["final"]["same_seed"], strict=True
        )
    )
    return table(["seed", "unsplit init", "(b) same_seed init", "same_seed - unsplit"], rows)


def refusals_table(refusals: list[tuple[dict[str, Any], str]]) -> str:
    """Settings and the message each was refused with."""
    return table(
        ["setting", "refused with"],
        (
            [", ".join(f"{k}={v!r}" for k, v in kwargs.items()), message]
            for kwargs, message in refusals
        ),
    )


def readme_table(result: LabResult) -> str:
    """The README's table: only what does not move between runs of the same command (no times,
    no peaks) — bitwise equality, bytes and messages, loss equality."""

    def sent(s: str, row: dict[str, Any]) -> str:
        text = f"{row['bytes_moved']:,} B in {row['messages']} message(s)"
        if s == "rng_replay":
            text += f" = {result['handoffs']} handoff(s) x {result['generator_state_bytes']:,} B"
        if s == "seed_checkpoint":
            text += f" + the {format_bytes(row['checkpoint_file_bytes'])} file"
        return text

    return table(
        ["", "bitwise = unsplit", "sent while initialising", "stages distinct"]
        + [f"loss = 1 process (rtol {LOSS_RTOL:g})"],
        (
            [label(s), YES[row["bitwise_equal"]], sent(s, row), YES[row["mesh"]["stages_distinct"]]]
            + [YES[row["loss_matches_baseline"]]]
            for s, row in result["strategies"].items()
        ),
    )
