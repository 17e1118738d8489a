"""Lab 05's figures: loss curves against single-process training, what init costs as the model
grows (memory, then time), init time on 1, 2, ... ranks, the convergence check, the same-seed
bug's draws; `figures` picks the ones a result has (the CLI saves them, the notebook shows them).

Every series a figure draws stays visible where it lies on another: each strategy has its own
marker and line style, markers are hollow, and series that share values by construction (rank 0
and the other ranks of a strategy that never builds the whole model) are drawn in a panel of
their own strategy, with different markers.
"""

from __future__ import annotations

from typing import Any

from fsdp_lab.choices import SEEDING_STRATEGIES as STRATEGIES
from fsdp_lab.labs.contract import LabResult
from fsdp_lab.pipeline.lab.config import LOSS_RTOL
from fsdp_lab.pipeline.lab.report import EXACT_SEEDING, label

_MARKERS = {"seed_checkpoint": "o", "same_seed": "s", "per_stage_seed": "^", "rng_replay": "D"}
_LINES = {"seed_checkpoint": "-", "same_seed": "--", "per_stage_seed": "-.", "rng_replay": ":"}


def style(strategy: str) -> dict[str, Any]:
    """Colour, marker and line style of `strategy`, the same in every figure; hollow markers."""
    i = STRATEGIES.index(strategy)
    return {
        "color": f"C{i}",
        "marker": _MARKERS[strategy],
        "ls": _LINES[strategy],
        "mfc": "none",
        "ms": 9 - i,  # nested: a marker on top of another leaves the one below visible
        "label": label(strategy),
    }


def _panels(columns: int, width: float, height: float = 4, **kw: Any) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(1, columns, squeeze=False, **kw)[0]
    return fig, list(axes)


def _offsets(strategies: list[str], step: float) -> dict[str, float]:
    """Small shifts along x so that strategies measured at the same x do not hide each other."""
    mid = (len(strategies) - 1) / 2
    return {s: (i - mid) * step for i, s in enumerate(strategies)}


def _mib(n: float) -> float:
    return n / 2**20


def loss_figure(result: LabResult) -> Any:
    """Loss per step of every initialised pipeline beside single-process training, and the
    relative difference from it (log scale; an exact match is drawn at the floor)."""
    fig, (left, right) = _panels(2, 12)
    base = result["baseline"]["losses"]
    steps = range(1, len(base) + 1)
    left.plot(steps, base, color="black", lw=4, alpha=0.3, label="unsplit baseline (1 process)")
    floor = 1e-10  # log scale: an exact match (0) would not be drawn at all
    for strategy, row in result["strategies"].items():
        rel = [max(abs(a - b) / abs(b), floor) for a, b in zip(row["losses"], base, strict=True)]
        left.plot(steps, row["losses"], markevery=max(1, len(base) // 10), **style(strategy))
        right.plot(steps, rel, markevery=max(1, len(base) // 10), **style(strategy))
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
    """Peak live bytes during init as the model grows: one panel per strategy, rank 0 and the
    highest of the other ranks, beside the whole model."""
    rows, strategies = result["growth"], list(result["strategies"])
    mib = [_mib(r["full_model_bytes"]) for r in rows]
    fig, axes = _panels(len(strategies), 3.2 * len(strategies) + 1, 3.8, sharey=True)
    for ax, strategy in zip(axes, strategies, strict=True):
        color = style(strategy)["color"]
        ax.plot(mib, mib, color="black", lw=6, alpha=0.15, label="the whole model")
        rank0 = [_mib(r[strategy]["peak_bytes_per_rank"][0]) for r in rows]
        ax.plot(mib, rank0, "o-", color=color, mfc="none", ms=10, label="rank 0")
        if result["world_size"] > 1:
            others = [_mib(max(r[strategy]["peak_bytes_per_rank"][1:])) for r in rows]
            ax.plot(mib, others, "x--", color=color, ms=7, label="other ranks (highest)")
        ax.set(title=label(strategy), xlabel="whole model (MiB fp32)")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("peak live tensors during init (MiB)")
    dims = ", ".join(str(r["dim"]) for r in rows)
    fig.suptitle(f"init peak per rank, width {dims}, L = {result['model']['n_layers']}")
    return fig


def growth_time_figure(result: LabResult) -> Any:
    """Init time as the model grows: the pipeline's (slowest rank, median of the repeats, bars
    from the fastest to the slowest repeat) and the busiest rank's CPU time."""
    rows, strategies = result["growth"], list(result["strategies"])
    mib = [_mib(r["full_model_bytes"]) for r in rows]
    shift = _offsets(strategies, 0.03)
    fig, (wall, cpu) = _panels(2, 12)
    for s in strategies:
        x = [m * (1 + shift[s]) for m in mib]
        mid = [r[s]["init_time_s"] * 1e3 for r in rows]
        low = [m - min(r[s]["init_time_s_runs"]) * 1e3 for m, r in zip(mid, rows, strict=True)]
        high = [max(r[s]["init_time_s_runs"]) * 1e3 - m for m, r in zip(mid, rows, strict=True)]
        wall.errorbar(x, mid, yerr=[low, high], capsize=3, **style(s))
        cpu.plot(x, [max(r[s]["cpu_time_s_per_rank"]) * 1e3 for r in rows], **style(s))
    n = result["repeats"]
    ticks = [f"{m:.3g} MiB\n(width {r['dim']})" for m, r in zip(mib, rows, strict=True)]
    for ax in (wall, cpu):
        ax.set_xscale("log")
        ax.set_xticks(mib, ticks)
        ax.minorticks_off()
        ax.set(xlabel="whole model (fp32)", ylabel="ms")
        ax.set_ylim(0, None)
    wall.set_title(f"wall time, slowest rank: median of {n} (bars: fastest..slowest repeat)")
    cpu.set_title("CPU time of the busiest rank (median): the work alone")
    wall.legend(fontsize=8)
    cpu.legend(fontsize=8)
    return fig


def scaling_figure(result: LabResult) -> Any:
    """Init time on 1, 2, ... ranks, one pipeline stage per rank, the model kept: the slowest
    rank's wall time beside the O(1) claim, and every rank's CPU time."""
    scaling = result["scaling"]
    rows, strategies = scaling["rows"], scaling["strategies"]
    ranks = [r["ranks"] for r in rows]
    shift = _offsets(strategies, 0.07)
    fig, (wall, cpu) = _panels(2, 12)
    for s in strategies:
        x = [n + shift[s] for n in ranks]
        mid = [r[s]["init_time_s"] * 1e3 for r in rows]
        low = [m - min(r[s]["init_time_s_runs"]) * 1e3 for m, r in zip(mid, rows, strict=True)]
        high = [max(r[s]["init_time_s_runs"]) * 1e3 - m for m, r in zip(mid, rows, strict=True)]
        wall.errorbar(x, mid, yerr=[low, high], capsize=3, **style(s))
        if s in EXACT_SEEDING and len(rows) > 1:
            wall.hlines(
                mid[0], ranks[0], ranks[-1], color=style(s)["color"], lw=1, alpha=0.6,
                label=f"claim O(1) for {label(s)}: flat at its {ranks[0]}-rank time",
            )  # fmt: skip
        per_rank = [[t * 1e3 for t in r[s]["cpu_time_s_per_rank"]] for r in rows]
        cpu.plot(x, [max(p) for p in per_rank], **style(s) | {"label": f"{label(s)}, busiest"})
        for xi, p in zip(x, per_rank, strict=True):
            cpu.scatter([xi] * len(p), p, s=12, color=style(s)["color"], alpha=0.5)
    cores = result["cores"]
    for ax in (wall, cpu):
        if cores is not None and ranks[-1] > cores:
            ax.axvspan(cores + 0.5, ranks[-1] + 0.5, color="grey", alpha=0.12, lw=0)
            ax.text(cores + 0.55, 0.02, f"more ranks than {cores} cores", fontsize=7,
                    transform=ax.get_xaxis_transform(), va="bottom")  # fmt: skip
        ax.set_xticks(ranks)
        ax.set_xlabel("ranks = pipeline stages")
        ax.set_ylim(0, None)
    dim, full = scaling["dim"], _mib(scaling["full_model_bytes"])
    wall.set(ylabel="ms", title=f"wall time, slowest rank (width {dim}, {full:.1f} MiB model)")
    cpu.set(ylabel="ms", title="CPU time per rank (dots: every rank; line: the busiest)")
    wall.legend(fontsize=7)
    cpu.legend(fontsize=7)
    return fig


def convergence_figure(result: LabResult) -> Any:
    """The learnable task: loss per step from the unsplit and the same-seed init at every seed,
    the task's floor; and each seed's final loss, the two inits side by side."""
    conv = result["convergence"]
    fig, (curves, final) = _panels(2, 12)
    looks = {
        "unsplit": {"color": "C0", "ls": "-", "marker": "o"},
        "same_seed": {"color": "C1", "ls": "--", "marker": "s"},
    }
    names = {"unsplit": "unsplit init (= (a), (d))", "same_seed": "(b) same_seed init"}
    for init, runs in conv["curves"].items():
        for k, curve in enumerate(runs):
            curves.plot(
                range(1, len(curve) + 1), curve, color=looks[init]["color"],
                ls=looks[init]["ls"], lw=1, alpha=0.8, label=names[init] if k == 0 else None,
            )  # fmt: skip
    curves.axhline(conv["entropy_floor"], color="black", lw=1, ls=":", label="the task's floor")
    curves.axhline(conv["uniform_loss"], color="grey", lw=1, ls="-.", label="ln V (guessing)")
    curves.set(xlabel="step", ylabel="loss", title="learnable task, Adam, one process per run")
    seeds = conv["seeds"]
    for i, init in enumerate(conv["final"]):
        x = [k + (i - 0.5) * 0.1 for k in range(len(seeds))]
        looks_here = looks[init] | {"ls": "none"}  # seeds are not a sequence: no line between
        final.plot(x, conv["final"][init], mfc="none", ms=9, label=names[init], **looks_here)
    final.set_xticks(range(len(seeds)), [str(s) for s in seeds])
    final.set(
        xlabel="seed",
        ylabel=f"mean loss, last {conv['tail_steps']} steps",
        title="final loss per seed",
    )
    curves.legend(fontsize=8)
    final.legend(fontsize=8)
    return fig


def same_seed_figure(result: LabResult) -> Any:
    """(b): stage 1's draws against stage 0's — at aligned layers, and in drawing order."""
    over = result["strategies"]["same_seed"]["overlap"]
    sample = over["samples"]
    fig, (aligned, ordered) = _panels(2, 10, 4.2)
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


def figures(result: LabResult) -> dict[str, Any]:
    """The ownership / RNG-travel diagram per strategy, loss curves, growth (memory and time),
    init time over ranks, convergence, the same-seed bug — each where the result has it."""
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
        figs["growth_time"] = growth_time_figure(result)
    if result["scaling"]:
        figs["scaling"] = scaling_figure(result)
    if result["convergence"]:
        figs["convergence"] = convergence_figure(result)
    same = result["strategies"].get("same_seed")
    if same is not None and same["overlap"]["samples"]:
        figs["same_seed_draws"] = same_seed_figure(result)
    return figs
