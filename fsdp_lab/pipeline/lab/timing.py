"""Lab 05, what init costs in time: every rank's repeats -> the pipeline's figures, and how
those figures move as the model grows or as ranks are added.

A wall time measured once on a shared machine moves with whatever else runs there: the ranks
take turns on the cores, and a rank that starts early waits for a late one inside the first
message. So each init is repeated with the ranks in step before every repeat
(`measure.measured_init`), the median is kept and the spread shown, and beside the wall time
(what the pipeline waits for) each rank's CPU time (its work alone) is kept. A time curve that
falls while the model grows, or grows with the ranks, is read against both.
"""

from __future__ import annotations

from statistics import median
from typing import Any

from fsdp_lab import measured
from fsdp_lab.pipeline.lab.config import PPSeedConfig


def init_costs(inits: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's measured init -> the pipeline's. The ranks start each repeat together, so a
    repeat's pipeline init time is its slowest rank's; the median over the repeats is kept, and
    the repeats themselves, for their spread."""
    walls = zip(*(i["init_time_s_runs"] for i in inits), strict=True)
    cpus = zip(*(i["cpu_time_s_runs"] for i in inits), strict=True)
    runs = [max(w) for w in walls]
    return {
        "peak_bytes_per_rank": [i["peak_bytes"] for i in inits],
        "init_time_s": median(runs),
        "init_time_s_runs": runs,
        "init_time_s_per_rank": [i["init_time_s"] for i in inits],
        "cpu_time_s_per_rank": [i["cpu_time_s"] for i in inits],
        "cpu_time_s_runs": [max(c) for c in cpus],
        "bytes_moved": int(sum(i["bytes_moved"] for i in inits)),  # whole bytes, counted as floats
        "bytes_moved_per_rank": [int(i["bytes_moved"]) for i in inits],
        "messages": sum(i["messages"] for i in inits),
    }


def trend(first: list[float], last: list[float]) -> str:
    """ "grows", "falls" or "flat": the repeats `last` against the repeats `first`, by the one
    rule every lab uses (`fsdp_lab.measured.order`: beyond the margin and the spread)."""
    return {1: "grows", -1: "falls", 0: "flat"}[measured.order(last, first)]


def scaling_rows(
    config: PPSeedConfig, scaling: list[dict[str, Any]], cores: int | None
) -> dict[str, Any]:
    """Per rank count, each strategy's init costs; per strategy, how its time moved.

    The wall-time trend is judged from the fewest ranks to the most that still had a core each
    (`cores`; all counts when fewer than two did): beyond that the ranks take turns on the cores
    and their wall time measures the turns. The CPU-time trends (the busiest rank's, all ranks'
    together) run over every count: CPU time leaves waiting out.
    """
    rows = [
        {"ranks": entry["ranks"]}
        | {s: init_costs([r[s] for r in entry["per_rank"]]) for s in config.scale_strategies}
        for entry in scaling
    ]
    fit = [r for r in rows if cores is None or r["ranks"] <= cores]
    judged = fit if len(fit) > 1 else rows
    trends: dict[str, Any] = {}
    if len(rows) > 1:
        for s in config.scale_strategies:
            a, b = judged[0][s], judged[-1][s]
            busy = [rows[i][s]["cpu_time_s_runs"] for i in (0, -1)]
            total = [sum(rows[i][s]["cpu_time_s_per_rank"]) for i in (0, -1)]
            trends[s] = {
                "wall": trend(a["init_time_s_runs"], b["init_time_s_runs"]),
                "wall_ratio": b["init_time_s"] / a["init_time_s"],
                "cpu": trend(*busy),
                "cpu_ratio": median(busy[1]) / median(busy[0]),
                "total_cpu_ratio": total[1] / total[0],
            }
    return {
        "dim": config.scale_width,
        "strategies": list(config.scale_strategies),
        "rows": rows,
        "judged_ranks": [judged[0]["ranks"], judged[-1]["ranks"]],
        "trends": trends,
    }


def growth_timing(config: PPSeedConfig, growth: list[dict[str, Any]]) -> dict[str, Any]:
    """Where, as the model grew, a strategy's init time *fell* (a hump in the time curve, beyond
    the repeats' spread: `trend`), in wall time and in the busiest rank's CPU time, and how far
    apart the repeats of one init lay (the largest slowest/fastest repeat ratio)."""
    dips: dict[str, dict[str, list[list[int]]]] = {"wall": {}, "cpu": {}}
    spread = 1.0
    for s in config.strategies:
        wall = [row[s]["init_time_s_runs"] for row in growth]
        cpu = [row[s]["cpu_time_s_runs"] for row in growth]
        for kind, times in (("wall", wall), ("cpu", cpu)):
            dips[kind][s] = [
                [growth[i]["dim"], growth[i + 1]["dim"]]
                for i in range(len(times) - 1)
                if trend(times[i], times[i + 1]) == "falls"
            ]
        for row in growth:
            runs = row[s]["init_time_s_runs"]
            spread = max(spread, max(runs) / min(runs))
    return {"dips": dips, "repeat_spread": spread}


def first_calls(ranks: list[dict[str, Any]], strategies: dict[str, Any]) -> dict[str, Any]:
    """Each strategy's first call in the rank processes (the warm-up, not kept: the slowest
    rank's) against the median of the measured calls at the same width, and their ratio."""
    out = {}
    for s, row in strategies.items():
        first = max(r["first_call_s"][s] for r in ranks)
        out[s] = {
            "first_s": first,
            "median_s": row["init_time_s"],
            "ratio": first / row["init_time_s"],
        }
    return out
