"""Notebook 06's paragraphs, built from a result: each claim follows its numbers both ways."""

from __future__ import annotations

from fsdp_lab.hsdp.lab import report
from fsdp_lab.labs.contract import LabResult

UNITS = [
    {"name": "root", "padded_numel": 2624, "shard_numel": 1312, "element_size": 4},
    *(
        {"name": f"blocks.{i}", "padded_numel": 12704, "shard_numel": 6352, "element_size": 4}
        for i in range(4)
    ),
]
ROOT, BLOCK, OWN = 2624 * 4, 12704 * 4, (1312 + 4 * 6352) * 4


def _memory(extra: dict[str, int]) -> LabResult:
    systems = {
        s: {"peak_model_state_bytes_per_rank": [1000 + extra[s]] * 4, "theory_peak_bytes": 1000,
            "units": UNITS}
        for s in ("full", "hybrid", "hybrid_zero2")
    }  # fmt: skip
    capacity = {
        "params": 7e9, "vram_bytes": 80e9, "gpus": 128, "shard_group": 8,
        "bytes_per_parameter": 16, "per_gpu_full": 875e6, "per_gpu_hybrid": 14e9,
        "largest_params_full": 640e9, "largest_params_hybrid": 40e9,
    }  # fmt: skip
    return LabResult("hsdp", {"systems": systems, "capacity": capacity})


def test_the_memory_excess_is_named_in_the_runs_units_or_not_at_all():
    text = report.memory_paragraph(
        _memory({"full": ROOT + BLOCK, "hybrid": 2 * BLOCK, "hybrid_zero2": OWN})
    )
    assert "full: 59.88 KiB above its formula — the root unit (10.25 KiB) and 1 more block" in text
    assert "hybrid: 99.25 KiB above its formula — 2 more blocks (49.62 KiB each)" in text
    assert "the rank's own parameter shard (4Ψ/S)" in text
    odd = report.memory_paragraph(_memory({"full": 7, "hybrid": -5, "hybrid_zero2": 0}))
    assert "7 B, not a whole number of the run's units" in odd
    assert "hybrid: at or under its formula (5 B under)" in odd


def _scaling(fsdp: list[float], hsdp: list[float]) -> LabResult:
    nodes = [1, 2, 4, 8, 16, 256]
    rows = {
        name: [
            {"nodes": n, "tflops_per_gpu": t, "node_nic_bytes": 1e9 * n, "comm_s": 0.1}
            for n, t in zip(nodes, values, strict=True)
        ]
        for name, values in (("fsdp", fsdp), ("hsdp", hsdp))
    }
    return LabResult("hsdp", {"network_model": {"nodes": nodes, "scaling": rows}})


def test_the_scaling_paragraph_says_where_model_and_chart_agree_from_both():
    # As this lab's model prices it: far apart at 2 nodes already, where the chart is not.
    text = report.scaling_paragraph(
        _scaling([180, 109, 104, 102, 98, 60], [180, 180, 180, 168, 156, 130])
    )
    assert "both put HSDP more than 10% above FSDP at 8, 16 nodes" in text
    assert "They part at 2, 4 nodes" in text and "the model 180 vs 109" in text
    # A model that tracked the chart would agree everywhere and part nowhere.
    chart = report.QUOTED_TFLOPS
    text = report.scaling_paragraph(_scaling([*chart["fsdp"], 50], [*chart["hsdp"], 170]))
    assert "They part" not in text and "at 8, 16 nodes" in text
