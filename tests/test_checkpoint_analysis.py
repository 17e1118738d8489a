"""Lab 02's analysis and report without ranks or timing: a hand-built measurement in, verdicts,
tables and figure stems out — and a miscounted call or all-gather is caught."""

from __future__ import annotations

import pytest
import torch

from fsdp_lab import theory
from fsdp_lab.checkpointing import schedules
from fsdp_lab.checkpointing.lab import CheckpointConfig
from fsdp_lab.checkpointing.lab.analysis import (
    COLUMNS,
    analyse,
    disagreements,
    frontier,
    revolve_frontier,
)
from fsdp_lab.checkpointing.lab.config import MODES
from fsdp_lab.checkpointing.lab.figures import figures
from fsdp_lab.checkpointing.lab.report import summary
from fsdp_lab.labs.contract import LabResult
from fsdp_lab.trace import MemoryTracker, category

N = 4
SCHEDULES = [
    schedules.store_all,
    schedules.full_recompute,
    schedules.every(2),
    schedules.segments(2),
    schedules.optimal(3),
    schedules.revolve(2),
]


def _row(schedule: schedules.Schedule) -> dict:
    """A row as measure_schedule makes it, counted exactly as the theory says."""
    cost = theory.checkpoint_cost(schedule, N)
    row = {
        "schedule": str(schedule),
        "n": N,
        "stored_activations": cost.stored_activations,
        "forward_calls": cost.forward_calls,
        "advances": cost.forward_calls - N,
        "repetitions": 1,
        "theory_stored_activations": cost.stored_activations,
        "theory_forward_calls": cost.forward_calls,
        "time_s": 1e-3 * cost.forward_calls,
        "time_min_s": 0.9e-3 * cost.forward_calls,
        "time_max_s": 1.1e-3 * cost.forward_calls,
        "repeats": 5,
        "peak_activation_bytes": 1024 * cost.stored_activations,
        "peak_total_bytes": 1024 * cost.stored_activations + 512,
        "max_abs_grad_diff": 0.0,
    }
    if schedule.name == "revolve":
        row["repetitions"] = row["theory_repetitions"] = theory.revolve_repetitions(N, 2)
    return row


def _binomial_row(s: int, r: int) -> dict:
    def counts(steps: int) -> dict:
        advances, reps = theory.revolve_advances(steps, s), theory.revolve_repetitions(steps, s)
        return {
            "steps": steps,
            "advances": advances,
            "repetitions": reps,
            "stored_activations": min(steps, s + 1),
            "theory_advances": advances,
            "theory_repetitions": reps,
        }

    steps = theory.binomial_reach(s, r)
    return {"snapshots": s, "repetitions": r, "at": counts(steps), "past": counts(steps + 1)}


def _trace() -> dict:
    with MemoryTracker() as mem, category("activations"):
        x = torch.ones(256)
        del x
    return mem.trace()


def measured(sharding: bool = True) -> dict:
    """What measure() returns for layers=(4,): every count equal to its theory."""
    gathers = {"plain": 8, "unit_wraps_checkpoint": 8, "checkpoint_spans_two_units": 10}
    return {
        "chains": {
            str(N): {
                "rows": [_row(s) for s in SCHEDULES],
                "versus_torch": {
                    "k": 2,
                    "store_all_peak_activation_bytes": 4096,
                    "ours_peak_activation_bytes": 3000,
                    "torch_peak_activation_bytes": 2000,
                    "max_abs_grad_diff_ours_vs_torch": 0.0,
                },
            }
        },
        "memory_traces": {"store_all": _trace(), "segments(2)": _trace()},
        "binomial_law": [_binomial_row(s, r) for s in (1, 2) for r in (1, 2)],
        "with_sharding": {
            m: {
                "units": 4,
                "world_size": 2,
                "all_gather_calls_per_step": float(gathers[m]),
                "all_gather_bytes_per_step": 256.0 * gathers[m],
                "max_abs_param_diff_vs_plain": 0.0,
            }
            for m in MODES
        }
        if sharding
        else None,
    }


CONFIG = CheckpointConfig(layers=(N,), world_size=2)


def test_counts_equal_to_theory_give_no_disagreement_and_the_cli_keys():
    result = analyse(CONFIG, measured())
    assert set(result) == {
        "config",
        "chains",
        "schedules",
        "with_sharding",
        "memory_traces",
        "binomial_law",
    }
    assert disagreements(result) == []
    assert summary(LabResult("checkpoint", result)).endswith("Every count equals its theory.")
    table = result["schedules"]["4"]
    assert list(table) == [
        "store_all",
        "full_recompute",
        "every(2)",
        "segments(2)",
        "optimal(3)",
        "revolve(2)",
    ]
    assert all(set(columns) == set(COLUMNS) for columns in table.values())
    assert table["full_recompute"]["forward_calls"] == 10  # N(N+1)/2
    assert result["chains"]["4"]["versus_torch"]["peak_ratio_ours_to_torch"] == 1.5


@pytest.mark.parametrize("field", ["forward_calls", "stored_activations"])
def test_a_miscounted_schedule_is_named(field):
    data = measured()
    data["chains"]["4"]["rows"][3][field] += 1  # segments(2) counted one too many
    result = analyse(CONFIG, data)
    (line,) = disagreements(result)
    assert line.startswith("N=4 segments(2):")
    text = summary(LabResult("checkpoint", result))
    assert "differ from their theory:" in text and "- N=4 segments(2)" in text


def test_a_revolve_that_breaks_the_binomial_law_is_named():
    data = measured()
    data["binomial_law"][3]["past"]["repetitions"] = 2  # s=2, r=2: 7 layers with r, not r + 1
    data["chains"]["4"]["rows"][5]["repetitions"] += 1  # revolve(2) on N=4 advanced too often
    lines = disagreements(analyse(CONFIG, data))
    assert lines == [
        "N=4 revolve(2): a layer advanced 3 times, binomial law 2",
        "revolve(2) on 7 layers: (advances, repetitions) (11, 2), binomial law (11, 3)",
    ]


def test_the_extra_all_gather_of_a_checkpoint_across_units_is_the_theory():
    spans = [m == "checkpoint_spans_two_units" for m in MODES]
    assert [theory.checkpoint_all_gathers(4, s, 2) for s in spans] == [8, 8, 10]
    assert theory.checkpoint_all_gathers(6, True, 3) == 15
    assert theory.checkpoint_all_gathers(6, True, 1) == 0  # one rank: the shard is everything
    data = measured()
    # As if the recompute found the first unit still gathered: no extra all-gather counted.
    data["with_sharding"]["checkpoint_spans_two_units"]["all_gather_calls_per_step"] = 8.0
    result = analyse(CONFIG, data)
    assert (
        result["with_sharding"]["checkpoint_spans_two_units"]["theory_all_gather_calls_per_step"]
        == 10
    )
    assert disagreements(result) == [
        "checkpoint_spans_two_units: 8 all-gathers per step, theory 10"
    ]


def test_the_frontiers_run_from_the_fewest_slots_to_store_all():
    front = frontier(8)
    assert [f["budget"] for f in front] == list(range(2, 9))
    assert all(f["stored_activations"] <= f["budget"] for f in front)
    calls = [f["forward_calls"] for f in front]
    assert calls == sorted(calls, reverse=True)  # more memory never costs calls
    assert calls[0] == 8 * 9 // 2 - 1 and calls[-1] == 8  # full recompute minus one; store-all
    assert analyse(CONFIG, measured())["chains"]["4"]["frontier"] == frontier(4)
    theirs = revolve_frontier(8)
    assert [f["snapshots"] for f in theirs] == list(range(1, 9))
    assert [f["stored_activations"] for f in theirs] == [2, 3, 4, 5, 6, 7, 8, 8]
    # At equal kept inputs, Griewank–Walther's plan is one optimal(b) could choose: never fewer.
    ours = {f["stored_activations"]: f["forward_calls"] for f in front}
    assert all(f["forward_calls"] >= ours[f["stored_activations"]] for f in theirs)
    assert theirs[0]["forward_calls"] == 8 * 9 // 2  # one snapshot: full recompute


def test_without_ranks_the_report_has_no_sharded_part_and_the_same_figure_stems():
    result = LabResult("checkpoint", analyse(CONFIG, measured(sharding=False)))
    assert result["with_sharding"] is None
    text = summary(result)
    assert "ZeRO-3" not in text
    assert "| segments(2) | 3 (3) | 6 (6) | 3.00 KiB | 3.50 KiB | 6.0 [5.4–6.6] | 0.0e+00 |" in text
    assert set(figures(result)) == {"memory_vs_compute", "trace_store_all", "trace_segments_2"}
