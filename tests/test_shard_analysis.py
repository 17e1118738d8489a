"""Lab 01's verdicts and tables, without a rank: `analysis.analyse` and `report` on measured data
written out by hand, with the formulas worked out here (N=2, Ψ=17 elements of 4 B, SGD)."""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp_lab.labs import LabResult
from fsdp_lab.sharding.lab import ShardConfig, figures, report
from fsdp_lab.sharding.lab.analysis import analyse, model_state_bytes

# Two units: the root (10 elements, no padding) and a block of 7 padded to 8 for N=2.
UNITS = [
    {"name": "root", "numel": 10, "padded_numel": 10, "shard_numel": 5, "element_size": 4},
    {"name": "blocks.0", "numel": 7, "padded_numel": 8, "shard_numel": 4, "element_size": 4},
]
# ZeRO-3 moves (N-1)/N of the padded Ψ (18 elements, 72 B): all-gather twice, reduce-scatter once;
# ZeRO-1 gathers once.
FULL_BYTES = {"all_gather_into_tensor": 2 * 0.5 * 72, "reduce_scatter_tensor": 0.5 * 72}
ZERO1_BYTES = {"all_gather_into_tensor": 0.5 * 72, "reduce_scatter_tensor": 0.5 * 72}
# DDP + ShardedOptimizer: all-reduce 2(N-1)/N·Ψ·b, then a broadcast of every parameter, Ψ·b.
SHARDED_OPTIMIZER_BYTES = {"all_reduce": 68.0, "broadcast": 68.0}
OWNED = [10, 7]  # elements whose momentum each rank keeps (whole parameters)


def _trace(rank: int, optimizer_state: int) -> dict:
    """The model state peaks at t=2 (700 B + state); the total peaks at t=1, on activations."""
    zeros = [0, 0, 0]
    by_category = {
        "parameters": [100, 100, 100],
        "gradients": [0, 0, 400],
        "optimizer_state": [0, optimizer_state, optimizer_state],
        "activations": [0, 5000, 0],
        "comm_buffers": [0, 300, 200],
        "other": zeros,
    }
    return {
        "rank": rank,
        "device": "cpu",
        "source": "storages",
        "categories": list(by_category),
        "t": [0.0, 1.0, 2.0],
        "bytes": by_category,
        "total": [sum(c[i] for c in by_category.values()) for i in range(3)],
        "markers": [{"t": 0.5, "label": "all-gather x"}, {"t": 1.5, "label": "free x"}],
        "peak_bytes": 5400 + optimizer_state,
        "peak_by_category": {},
    }


def _params(offset: float = 0.0) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([1.0, 2.0]) + offset, "b": torch.tensor([0.5])}


def _measured(strategy: str = "full") -> dict:
    ours_bytes = FULL_BYTES if strategy == "full" else ZERO1_BYTES
    ours = [
        {
            "losses": [3.0, 2.5],
            "step_time_s": 0.01 * (r + 1),
            "params": _params(),
            "comm_bytes_per_step": dict(ours_bytes),
            "calls_per_step": {op: 2.0 for op in ours_bytes},
            "memory_trace": _trace(r, 60 + r),
            "timeline": {"rank": r, "spans": []},
            "units": UNITS,
        }
        for r in range(2)
    ]
    sharded_optimizer = [
        {
            "losses": [3.0, 2.5],
            "params": _params(),
            "memory_trace": _trace(r, 4 * OWNED[r]),
            "comm_bytes_per_step": dict(SHARDED_OPTIMIZER_BYTES),
            "calls_per_step": {"all_reduce": 1.0, "broadcast": 2.0},
            "owned_numel_per_rank": OWNED,
            "owned_tensors_per_rank": [1, 1],
            "trainable_numel": 17,
            "element_size": 4,
        }
        for r in range(2)
    ]
    return {
        "world_size": 2,
        "backend": "gloo",
        "vocab_size": 32,
        "ours": ours,
        "fsdp2": [{"losses": [3.0, 2.5], "step_time_s": 0.5, "params": _params()}] * 2,
        "sharded_optimizer": sharded_optimizer if strategy == "optimizer" else None,
        "zero_redundancy": [_params(0.25)] * 2 if strategy == "optimizer" else None,
        "single_process": _params(1e-3),
    }


CONFIG = ShardConfig(strategy="full", steps=2, optimizer="sgd")
ZERO1 = ShardConfig(strategy="optimizer", steps=2, optimizer="sgd")


def test_the_model_state_leaves_activations_out_and_counts_the_gathered_buffers():
    # t=1: 100 + 0 + 60 + 300 (activations left out); t=2: 100 + 400 + 60 + 200
    assert model_state_bytes(_trace(0, 60)) == [100, 460, 760]


def test_agreement_peaks_and_bytes_against_the_hand_worked_formulas():
    data = analyse(CONFIG, _measured())
    assert data["world_size"] == 2 and data["config"]["world_size"] == 2
    assert data["max_abs_diff_vs_single_process"] == pytest.approx(1e-3, rel=1e-3)
    assert data["max_abs_diff_vs_fsdp2"] == 0.0
    assert data["fsdp2_max_abs_diff_vs_single_process"] == pytest.approx(1e-3, rel=1e-3)
    assert data["theory_comm_bytes"] == FULL_BYTES
    assert data["theory"]["psi"] == 17 and data["theory"]["psi_padded"] == 18
    # SGD with momentum, ZeRO-3: 12 B x 17 / 2 ranks, plus the largest gathered unit (40 B).
    assert data["theory_peak_bytes"] == 12 * 17 / 2 + 40
    assert data["comm_matches_theory"] is True
    assert data["peak_model_state_bytes_per_rank"] == [760, 761]
    assert data["optimizer_state_bytes_per_rank"] == [60, 61]
    assert data["peak_bytes_per_rank"] == [5460, 5461]
    assert data["step_time_s"] == 0.02  # the slowest rank
    assert data["units"] == UNITS and data["sharded_optimizer"] is None


@pytest.mark.parametrize(
    "change",
    [
        lambda b: b.update(reduce_scatter_tensor=b["reduce_scatter_tensor"] + 1),  # one byte more
        lambda b: b.pop("all_gather_into_tensor"),  # a collective missing
        lambda b: b.update(all_reduce=1.0),  # a collective too many
    ],
)
def test_one_rank_off_the_formula_flips_the_verdict(change):
    measured = _measured()
    change(measured["ours"][1]["comm_bytes_per_step"])
    data = analyse(CONFIG, measured)
    assert data["comm_matches_theory"] is False
    assert "measured equals theory on every rank: False" in report.summary(LabResult("shard", data))


def test_the_padded_formula_is_the_one_compared():
    measured = _measured()
    unpadded = {"all_gather_into_tensor": 2 * 0.5 * 68, "reduce_scatter_tensor": 0.5 * 68}
    for rank in measured["ours"]:
        rank["comm_bytes_per_step"] = dict(unpadded)
    data = analyse(CONFIG, measured)
    assert data["theory_comm_bytes_unpadded"] == unpadded
    assert data["comm_matches_theory"] is False


def test_without_fsdp2_its_entries_are_none_and_the_summary_leaves_them_out():
    measured = _measured()
    measured["fsdp2"] = None
    data = analyse(CONFIG, measured)
    assert data["max_abs_diff_vs_fsdp2"] is None and data["fsdp2_step_time_s"] is None
    text = report.summary(LabResult("shard", data))
    assert "FSDP2" not in text and "measured equals theory on every rank: True" in text


def test_the_sharded_optimizer_beside_zero1():
    data = analyse(ZERO1, _measured("optimizer"))
    so = data["sharded_optimizer"]
    assert so["theory"]["comm_bytes"] == SHARDED_OPTIMIZER_BYTES
    assert so["comm_matches_theory"] is True
    # SGD momentum: 4 B per element a rank owns; rank 0 owns 10 of 17 where 8.5 is even.
    assert so["optimizer_state_bytes_per_rank"] == so["theory"]["optimizer_state_bytes_per_rank"]
    assert so["optimizer_state_bytes_per_rank"] == [40, 28]
    assert so["theory"]["largest_share_over_even_split"] == pytest.approx(10 / 8.5)
    assert so["max_abs_diff_vs_zero1_transformation"] == 0.0
    assert so["max_abs_diff_vs_zero_redundancy_optimizer"] == 0.25
    assert so["max_abs_diff_vs_single_process"] == pytest.approx(1e-3, rel=1e-3)
    text = report.summary(LabResult("shard", data))
    assert "DDP + ShardedOptimizer bytes equal their formula on every rank: True" in text
    assert "busiest rank's share of the state / even split: 1.176" in text

    broken = _measured("optimizer")
    broken["sharded_optimizer"][0]["comm_bytes_per_step"]["broadcast"] = 34.0  # half a broadcast
    so = analyse(ZERO1, broken)["sharded_optimizer"]
    assert so["comm_matches_theory"] is False


def test_the_zero1_table_sets_both_zero1s_beside_their_formulas():
    table = report.sharded_optimizer_table(
        LabResult("shard", analyse(ZERO1, _measured("optimizer")))
    )
    state, _, collectives = table.partition("\n\n")
    assert state.splitlines()[2] == "| 0 | 10 | 40 B | 40 B | 34 B | 60 B |"
    rows = collectives.splitlines()
    # shard(strategy="optimizer") measured and its formula, then the sharded optimizer's
    assert rows[2] == "| all_gather_into_tensor | 36 B | 36 B | - | - |"
    assert rows[4] == "| all_reduce | - | - | 68 B | 68 B |"
    assert rows[6] == "| total | 72 B | 72 B | 136 B | 136 B |"


def test_figures_keep_their_stems():
    data = analyse(CONFIG, _measured())
    assert set(figures(LabResult("shard", data))) == {
        "memory_trace",
        "bytes_vs_theory",
        "timeline",
    }


def test_peak_table_reads_the_model_state_peak_not_the_activation_peak():
    trace = copy.deepcopy(_trace(0, 200))
    trace["bytes"]["comm_buffers"] = [0, 300, 0]
    result = {"memory_traces": [trace], "theory_peak_bytes": 600}
    header, rule, row = report.peak_table({"demo": result}).splitlines()
    assert header.count("|") == rule.count("|") == row.count("|")
    # t=2: 100 + 400 + 200 + 0 = 700 beats t=1: 100 + 0 + 200 + 300 = 600
    assert row == "| demo | 600 B | 700 B | 100 B | 400 B | 200 B | 0 B | free x |"


def _root_run(kept: bool, optimizer_state: int = 60) -> LabResult:
    """A run whose root unit (10 elements) stays gathered after forward, or is freed too."""
    measured = _measured()
    units = [
        {**UNITS[0], "reshard_after_forward": not kept},
        {**UNITS[1], "reshard_after_forward": True},
    ]
    gathered = 0.5 * (18 + (8 if kept else 18)) * 4  # forward: all; backward: what was freed
    for r, o in enumerate(measured["ours"]):
        o["units"] = units
        o["comm_bytes_per_step"] = {
            "all_gather_into_tensor": gathered,
            "reduce_scatter_tensor": 36.0,
        }
        o["calls_per_step"] = {"all_gather_into_tensor": 3.0 if kept else 4.0}
        o["memory_trace"] = _trace(r, optimizer_state)
    return LabResult("shard", analyse(CONFIG, measured))


def test_keeping_the_root_is_compared_from_the_measurement_both_ways():
    kept, freed = _root_run(True), _root_run(False)
    assert kept["comm_matches_theory"] and freed["comm_matches_theory"]  # theory follows the flag
    text = report.root_kept_report(kept, freed)
    assert "**20 B more all-gather per step** (1 more call)" in text
    assert "of the root unit is 20 B — exactly that." in text
    assert "did **not** lower the peak" in text
    assert "the last block, `blocks.0`, was freed after forward" in text

    lower = report.root_kept_report(kept, _root_run(False, optimizer_state=20))
    assert "It lowered the peak model state by 40 B." in lower and "did **not**" not in lower


# -- notebook 01's sentences on what fills each strategy's peak (issue 25, item 1) ------------

PSI = 53_440  # TinyGPT's parameters: 4Ψ = 208.75 KiB


def _run_at_peak(strategy: str, n: int, held: dict, prefetch: bool = True):
    """A shard-lab result whose memory trace peaks once, holding `held` (bytes by category)."""
    from fsdp_lab.labs.contract import LabResult
    from fsdp_lab.sharding.lab.analysis import MODEL_STATE

    trace = {
        "t": [0.0, 1.0],
        "bytes": {c: [0, held.get(c, 0)] for c in MODEL_STATE},
        "markers": [{"t": 0.5, "label": "reduce-scatter blocks.3"}],
    }
    units = [
        {"name": "root", "padded_numel": 2624, "element_size": 4},
        *({"name": f"blocks.{i}", "padded_numel": 12704, "element_size": 4} for i in range(4)),
    ]
    theory = {"psi": PSI, "psi_padded": PSI, "bytes_per_element": 4, "largest_unit_bytes": 50816}
    return LabResult(
        "shard",
        {"memory_traces": [trace], "theory": theory, "world_size": n, "units": units,
         "config": {"prefetch": prefetch}, "strategy": strategy},
    )  # fmt: skip


def test_peak_explanations_say_what_the_table_shows_both_ways():
    from fsdp_lab.sharding.lab.report import peak_explanations

    whole, own = 4 * PSI, 4 * PSI // 2
    ddp = {"parameters": whole, "gradients": whole, "optimizer_state": 2 * whole + 208}
    text = peak_explanations({"none": _run_at_peak("none", 2, ddp)})
    assert "nothing is gathered (`comm_buffers` 0 B)" in text and "exactly 4Ψ" in text
    assert "208 B beyond 8Ψ" in text
    # If DDP's parameters were filed under comm_buffers, the sentence would say so instead.
    moved = {**ddp, "parameters": 0, "comm_buffers": whole}
    text = peak_explanations({"none": _run_at_peak("none", 2, moved)})
    assert "nothing is gathered" not in text and "`comm_buffers` holds 208.75 KiB" in text

    zero1 = {
        "parameters": own,
        "gradients": whole,
        "optimizer_state": 2 * own,
        "comm_buffers": whole,
    }
    text = peak_explanations({"optimizer": _run_at_peak("optimizer", 2, zero1)})
    assert "gradients exactly 4Ψ (208.75 KiB)" in text and "under" not in text
    fewer = {**zero1, "gradients": whole - 16_916}
    text = peak_explanations({"optimizer": _run_at_peak("optimizer", 2, fewer)})
    assert "16.52 KiB under 4Ψ" in text and "already been reduce-scattered" in text

    full = {"parameters": own, "gradients": own, "optimizer_state": 2 * own}
    three = {**full, "comm_buffers": 2624 * 4 + 2 * 12704 * 4}
    text = peak_explanations({"full": _run_at_peak("full", 2, three)})
    assert "the root unit (10.25 KiB) and 2 block(s)" in text and "prefetched" in text
    text = peak_explanations({"full": _run_at_peak("full", 2, three, prefetch=False)})
    assert "prefetched" not in text
    odd = {**full, "comm_buffers": 12704 * 4 + 7}
    assert "the root unit" not in peak_explanations({"full": _run_at_peak("full", 2, odd)})


def test_one_rank_sends_nothing_and_that_matches_the_formulas():
    """One rank calls no collective at all (nothing to gather, reduce or broadcast): its empty
    ledger matches formulas of 0 bytes — the lab said "False" beside 0 B = 0 B tables."""
    from fsdp_lab import theory
    from fsdp_lab.sharding.lab.analysis import same_bytes

    alone = theory.sharded_optimizer_step([100], 100, 4, "adam", 1)["comm_bytes"]
    assert alone == {"all_reduce": 0.0, "broadcast": 0.0}
    assert same_bytes({}, alone) and same_bytes({"all_gather": 0.0}, {})
    assert not same_bytes({"all_gather": 8.0}, {}) and not same_bytes({}, {"broadcast": 8.0})
