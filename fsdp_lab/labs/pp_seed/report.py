"""Lab 05, shown: who owns what and where the seed travels, per strategy (`fsdp_lab.diagrams`);
loss curves against single-process training; what init costs as the model grows; the same-seed
bug's draws; and the tables the notebook and the CLI print."""

from __future__ import annotations

from typing import Any

from fsdp_lab.choices import SEEDING_STRATEGIES as STRATEGIES
from fsdp_lab.labs.contract import LabResult
from fsdp_lab.labs.pp_seed.analysis import LOSS_RTOL
from fsdp_lab.markdown import table
from fsdp_lab.sizes import format_bytes


def _label(strategy: str) -> str:
    """The strategy with the letter the notebook and the README give it: (a) ... (d)."""
    return f"({'abcd'[STRATEGIES.index(strategy)]}) {strategy}"


def _two_panels(width: float, height: float = 4) -> tuple[Any, Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, *fig.subplots(1, 2)


def _peaks(peaks: list[int]) -> tuple[str, str]:
    """Rank 0's peak, and the highest of the other ranks' ("-" on one rank)."""
    return format_bytes(peaks[0]), format_bytes(max(peaks[1:])) if len(peaks) > 1 else "-"


def figures(result: LabResult) -> dict[str, Any]:
    """The ownership / RNG-travel diagram per strategy, loss curves, growth, the same-seed bug."""
    from fsdp_lab.diagrams import pipeline_diagram
    from fsdp_lab.pipeline import PipeGPTConfig

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


def loss_figure(result: LabResult) -> Any:
    """Loss per step of every initialised pipeline beside single-process training, and the
    relative difference from it (log scale; an exact match is drawn at the floor)."""
    fig, left, right = _two_panels(12)
    base = result["baseline"]["losses"]
    steps = range(1, len(base) + 1)
    left.plot(steps, base, color="black", lw=4, alpha=0.3, label="unsplit baseline (1 process)")
    floor = 1e-10  # log scale: an exact match (0) would not be drawn at all
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
    rows = result["growth"]
    mib = [r["full_model_bytes"] / 2**20 for r in rows]
    fig, mem, tim = _two_panels(12)
    mem.plot(mib, mib, color="black", lw=4, alpha=0.2, label="the whole model")
    for i, strategy in enumerate(result["strategies"]):
        color, label = f"C{i}", _label(strategy)
        rank0 = [r[strategy]["peak_bytes_per_rank"][0] / 2**20 for r in rows]
        mem.plot(mib, rank0, "o-", color=color, label=f"{label}, rank 0")
        if result["world_size"] > 1:
            others = [max(r[strategy]["peak_bytes_per_rank"][1:]) / 2**20 for r in rows]
            mem.plot(mib, others, "x--", color=color, label=f"{label}, other ranks")
        seconds = [max(r[strategy]["init_time_s_per_rank"]) for r in rows]
        tim.plot(mib, seconds, "o-", color=color, label=label)
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
    over = result["strategies"]["same_seed"]["overlap"]
    sample = over["samples"]
    fig, aligned, ordered = _two_panels(10, 4.2)
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
    """One Markdown row per strategy: equal to the unsplit init?, memory, time, bytes, loss."""
    head = ["strategy", "bitwise = unsplit", "max abs diff", "peak rank 0", "peak other ranks"]
    head += ["init time", "bytes moved", "messages", "final loss", "loss = baseline"]
    yes = {True: "yes", False: "no"}
    return table(
        head,
        (
            [_label(s), yes[row["bitwise_equal"]], f"{row['max_abs_diff']:.3g}"]
            + [*_peaks(row["peak_bytes_per_rank"]), f"{row['init_time_s'] * 1e3:.1f} ms"]
            + [f"{row['bytes_moved']:,.0f} B", row["messages"], f"{row['final_loss']:.4f}"]
            + [f"{yes[row['loss_matches_baseline']]} (max rel diff {row['loss_max_rel_diff']:.1e})"]
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
            [_label(strategy), num(o["first_layer_corr_0_1"], ".3f")]
            + [num(o["first_layer_corr_1_2"], ".3f"), same]
            + [num(o["shared_prefix_values_0_1"], ","), fractions]
            + [num(o["stages_distinct"], ""), num(mesh["replicas_equal"], "")]
        )
    return table(head, rows)


def growth_table(result: LabResult) -> str:
    """Per width: the whole model, and per strategy rank 0's peak / the others', slowest init."""
    strategies = list(result["strategies"])
    head = ["dim", "whole model"] + [f"{_label(s)} peak rank 0 / others, time" for s in strategies]

    def cell(r: dict[str, Any]) -> str:
        rank0, others = _peaks(r["peak_bytes_per_rank"])
        return f"{rank0} / {others}, {max(r['init_time_s_per_rank']) * 1e3:.1f} ms"

    return table(
        head,
        (
            [row["dim"], format_bytes(row["full_model_bytes"])] + [cell(row[s]) for s in strategies]
            for row in result["growth"]
        ),
    )


def summary(result: LabResult) -> str:
    """The layout, then the results, overlap and (if measured) growth tables, in Markdown."""
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
    if r["growth"]:
        lines += ["", growth_table(r)]
    return "\n".join(lines)
