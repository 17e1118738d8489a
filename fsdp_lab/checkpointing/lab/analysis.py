"""Lab 02, the verdicts: counted calls and kept inputs against `theory.checkpoint_cost`, the
two optimal frontiers (ours and Griewank–Walther's), the binomial law, and the all-gathers a
checkpoint's place costs under ZeRO-3.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fsdp_lab import theory
from fsdp_lab.checkpointing.lab.config import CheckpointConfig

# Per schedule, what the JSON's "schedules" table keeps of a measured row.
COLUMNS = ("peak_activation_bytes", "forward_calls", "time_s", "max_abs_grad_diff")


def frontier(n: int) -> list[dict[str, int]]:
    """optimal(b)'s (kept inputs, calls) for every budget b: no schedule that keeps at most b
    layer inputs makes fewer calls. Optimal in *kept inputs*, not in bytes: a layer of a tape
    holds its internals too (checkpointing/schedules.py, [Note: what a slot costs])."""
    from fsdp_lab.checkpointing import schedules  # torch; the report of a saved result needs none

    return [
        asdict(theory.checkpoint_cost(schedules.optimal(b), n)) | {"budget": b}
        for b in range(schedules.min_budget(n), n + 1)
    ]


def revolve_frontier(n: int) -> list[dict[str, int]]:
    """revolve(s)'s (kept inputs, calls) for s = 1..N: Griewank–Walther's optimum in their
    units (advances, snapshots), drawn in ours (every call, s + 1 kept inputs)."""
    from fsdp_lab.checkpointing import schedules

    return [
        asdict(theory.checkpoint_cost(schedules.revolve(s), n)) | {"snapshots": s}
        for s in range(1, n + 1)
    ]


def disagreements(result: dict[str, Any]) -> list[str]:
    """Every count that differs from its theory, as a sentence; empty when all agree."""
    out = []
    for n, chain in result["chains"].items():
        for r in chain["rows"]:
            counted = (r["forward_calls"], r["stored_activations"])
            predicted = (r["theory_forward_calls"], r["theory_stored_activations"])
            if counted != predicted:
                out.append(
                    f"N={n} {r['schedule']}: (calls, kept inputs) {counted}, theory {predicted}"
                )
            if "theory_repetitions" in r and r["repetitions"] != r["theory_repetitions"]:
                out.append(
                    f"N={n} {r['schedule']}: a layer advanced {r['repetitions']} times, "
                    f"binomial law {r['theory_repetitions']}"
                )
    for row in result.get("binomial_law") or []:
        for c in (row["at"], row["past"]):
            counted = (c["advances"], c["repetitions"])
            predicted = (c["theory_advances"], c["theory_repetitions"])
            if counted != predicted:
                out.append(
                    f"revolve({row['snapshots']}) on {c['steps']} layers: (advances, "
                    f"repetitions) {counted}, binomial law {predicted}"
                )
    for mode, s in (result["with_sharding"] or {}).items():
        counted, predicted = s["all_gather_calls_per_step"], s["theory_all_gather_calls_per_step"]
        if counted != predicted:
            out.append(f"{mode}: {counted:g} all-gathers per step, theory {predicted}")
    return out


def analyse(config: CheckpointConfig, measured: dict[str, Any]) -> dict[str, Any]:
    """The measured rows and runs -> the lab's result (JSON types only)."""
    chains = {}
    for n, c in measured["chains"].items():
        v = c["versus_torch"]
        ratio = v["ours_peak_activation_bytes"] / v["torch_peak_activation_bytes"]  # 1: same bytes
        chains[n] = {
            "n": int(n),
            "rows": c["rows"],
            "frontier": frontier(int(n)),
            "revolve_frontier": revolve_frontier(int(n)),
            "versus_torch": v | {"peak_ratio_ours_to_torch": ratio},
        }
    sharding = measured["with_sharding"]
    if sharding is not None:
        sharding = {
            mode: s
            | {
                "theory_all_gather_calls_per_step": theory.checkpoint_all_gathers(
                    s["units"], mode == "checkpoint_spans_two_units", s["world_size"]
                )
            }
            for mode, s in sharding.items()
        }
    return {
        "config": asdict(config),
        "chains": chains,
        "schedules": {
            n: {r["schedule"]: {k: r[k] for k in COLUMNS} for r in c["rows"]}
            for n, c in chains.items()
        },
        "binomial_law": measured["binomial_law"],
        "with_sharding": sharding,
        "memory_traces": measured["memory_traces"],
    }
