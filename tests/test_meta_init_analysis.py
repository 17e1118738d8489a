"""Lab 04 without a cluster: the analysis (per-rank figures regrouped, the slowest rank's time,
theory beside the measurements, verdicts over every size), the report built from it, and the
config's options as the command line spells them."""

from __future__ import annotations

import argparse
import json

import pytest
from matplotlib.figure import Figure

from fsdp_lab import theory
from fsdp_lab.labs.contract import LabResult
from fsdp_lab.labs.meta_init import MetaInitConfig, analysis, report
from fsdp_lab.labs.meta_init.config import APPROACHES, CONTROL, MODES
from fsdp_lab.labs.options import add_config_arguments, config_overrides, to_flags

MiB = 2**20


def _rss(peak: int) -> dict:
    return {"t": [0.0, 0.1, 0.2], "bytes": [0, peak, peak // 2], "marks": []}


def _materialise(n: int = 2) -> dict:
    """What `measure.measure_materialisation` returns: an 8 MiB model, a 1 MiB largest unit."""
    runs = {
        mode: [
            {
                "rss": _rss((i + 1) * MiB),
                "rss_start_bytes": 100 * MiB,
                "rss_growth_bytes": (i + 1) * MiB + r,  # rank r's figures differ by r bytes
                "rss_after_trim_bytes": 4 * MiB + r,
                "peak_bytes": (i + 5) * MiB + r,
                "after_bytes": 4 * MiB,
                "time_s": 0.1 * (i + 1),
            }
            for r in range(n)
        ]
        for i, mode in enumerate(MODES)
    }
    return {
        "model": {"dim": 64},
        "model_mb": 8,
        "full_model_bytes": 8 * MiB,
        "buffer_bytes": 4096,
        "units": 5,
        "largest_unit_bytes": MiB,
        "runs": runs,
    }


def _size(model_mb: int, n: int = 2, wrong: dict | None = None, control: bool = False) -> dict:
    """What `measure.measure_size` returns; `wrong`: approach -> mismatched parameter names."""
    params, buffers = model_mb * MiB, 1024
    runs = {}
    for approach in (*APPROACHES, CONTROL) if control else APPROACHES:
        moved = params + buffers if approach == "sync_module_states" and n > 1 else 0
        runs[approach] = {
            "per_rank": [
                {
                    "time_s": 1.0 + r,  # the last rank is the slowest
                    "bytes_moved": moved,
                    "bytes_by_op": {"broadcast": moved} if moved else {},
                    "comm_time_s": 0.5 if moved else 0.0,
                }
                for r in range(n)
            ],
            "mismatched_parameters": (wrong or {}).get(approach, []),
            "mismatched_buffers": [],
        }
    return {
        "model_mb": model_mb,
        "model": {"dim": 64},
        "parameters": params // 4,
        "parameter_bytes": params,
        "buffer_bytes": buffers,
        "runs": runs,
    }


KAIMING = {
    "shape": [512, 256],
    "world_size": 2,
    "row_shards_max_abs_diff": [0.0, 0.1],
    "row_shards_equal_own_rows": [True, False],
    "row_shards_equal_first_rows": [True, True],
    "bound_full": 0.0625,
    "bound_column_shard": 0.0884,
    "max_abs_full": 0.06,
    "max_abs_column_shard": 0.08,
    "deterministic_slices_equal_full": True,
    "deterministic_max_abs": 0.06,
}
TIES = {
    "param_init_fn": {
        "tied_on_meta": True,
        "problems_after_shard": [],
        "output_equals_embedding": True,
    },
    "shard_init": {
        "tied_on_meta": True,
        "problems_after_shard": [],
        "output_equals_embedding": True,
    },
    "to_empty": {
        "tied_after_to_empty": False,
        "problems": ["x"],
        "shard_refused": True,
        "shard_error": "retie",
    },
}
SEVENTY = {
    "build_time_s": 0.2,
    "rss_start_bytes": 1,
    "rss_growth_bytes": 4 * MiB,
    "second_build": {"build_time_s": 0.1, "rss_start_bytes": 1, "rss_growth_bytes": 2},
    "summary": {"parameters": 70_553_706_496, "parameter_bytes": 4 * 70_553_706_496},
    "config": {},
}


def _measured(seventy: dict | None = SEVENTY) -> dict:
    return {
        "world_size": 2,
        "backend": "gloo",
        "seventy_b": seventy,
        "materialise": _materialise(),
        "ties": [TIES, TIES],
        "agreement": [_size(8, control=True), _size(16)],
        "kaiming_on_a_shard": KAIMING,
    }


def test_materialisation_regroups_per_rank_and_sets_the_theory_beside():
    memory = analysis.materialisation(_materialise(n=2))
    # 8 MiB over 2 ranks: the whole model and its shards; the shards and one unit; the shards.
    assert memory["theory_peak_bytes"] == {
        "ordinary": 12 * MiB,
        "meta_param_init_fn": 5 * MiB,
        "meta_shard_init": 4 * MiB,
    }
    assert list(memory["modes"]) == list(MODES)
    unit_by_unit = memory["modes"]["meta_param_init_fn"]
    assert unit_by_unit["how"] == MODES["meta_param_init_fn"]
    assert unit_by_unit["peak_bytes"] == [6 * MiB, 6 * MiB + 1]  # rank order kept
    assert unit_by_unit["rss_growth_bytes"] == [2 * MiB, 2 * MiB + 1]
    assert len(unit_by_unit["rss"]) == 2 and "runs" not in memory
    four = analysis.materialisation(_materialise(n=4))["theory_peak_bytes"]
    assert four["meta_shard_init"] == 2 * MiB  # the ranks are counted from the runs


@pytest.mark.parametrize("n", [1, 2, 3])
def test_agreement_row_takes_the_slowest_rank_and_the_broadcast_theory(n):
    row = analysis.agreement_row(_size(16, n=n, wrong={"deterministic": ["output.weight"]}))
    sync, det = row["sync_module_states"], row["deterministic"]
    assert sync["time_s"] == 1.0 + (n - 1)  # the slowest rank, not rank 0
    assert sync["time_s_per_rank"] == [1.0 + r for r in range(n)]
    model = 16 * MiB + 1024
    assert sync["theory_bytes_moved"] == (model if n > 1 else 0)  # one rank: nothing to send
    assert sync["bytes_moved_per_rank"] == [sync["theory_bytes_moved"]] * n
    assert det["theory_bytes_moved"] == 0
    assert sync["bitwise_equal_to_reference"] is True
    assert det["bitwise_equal_to_reference"] is False
    assert det["mismatched_parameters"] == ["output.weight"]
    assert row["parameter_bytes"] == 16 * MiB and "runs" not in row


def test_agreement_figures_are_the_largest_size_and_verdicts_every_size():
    sizes = [_size(8, wrong={"deterministic": ["x"]}, control=True), _size(16)]
    sizes[0]["runs"][CONTROL]["mismatched_parameters"] = ["layers.0.attention.wq.weight"]
    result = analysis.agreement(sizes)
    det = result["approaches"]["deterministic"]
    assert det["model_mb"] == 16 and det["time_s"] == 2.0
    assert det["bitwise_equal_to_reference"] is False  # the 8 MiB row failed: so does the verdict
    sync = result["approaches"]["sync_module_states"]
    assert sync["bytes_moved"] == sync["theory_bytes_moved"] == 16 * MiB + 1024
    assert sync["bitwise_equal_to_reference"] is True
    assert result["control"]["bitwise_equal_to_reference"] is False  # the smallest size's run
    assert [r["model_mb"] for r in result["rows"]] == [8, 16]


def test_analyse_has_the_issue_keys_and_the_70b_model_state():
    config = MetaInitConfig(model_mb=8, sizes_mb=(8, 16))
    data = analysis.analyse(config, _measured())
    json.dumps(data)
    assert data["config"]["world_size"] == 2 and data["config"]["sizes_mb"] == (8, 16)
    assert data["parameters_70b"] == SEVENTY["summary"]["parameters"]
    assert data["build_time_s_70b"] == 0.2 and data["rss_growth_bytes_70b"] == 4 * MiB
    assert data["peak_bytes_per_rank"] == [6 * MiB, 6 * MiB + 1]  # the unit-by-unit path
    assert data["full_model_bytes"] == 8 * MiB
    costs = data["seventy_b"]["per_rank_model_state_bytes"]
    assert list(costs) == ["1", "8", "64", "512"]
    psi = SEVENTY["summary"]["parameters"]
    assert costs["64"] == theory.zero_table(psi, 64)
    assert costs["64"]["full"] == pytest.approx(16 * psi / 64)  # fp32 Adam, ZeRO-3
    without = analysis.analyse(config, _measured(seventy=None))
    assert without["seventy_b"] is None and without["parameters_70b"] is None


def test_summary_and_figures_from_an_analysed_result():
    result = LabResult("meta-init", analysis.analyse(MetaInitConfig(), _measured()))
    text = report.summary(result)
    assert "70.55e9 parameters" in text
    assert "| ordinary build, then shard | 1.00 MiB |" in text  # rank 0's growth
    assert "(12.00 MiB)" in text  # the ordinary build's theory peak
    assert "| 16.00 MiB | sync_module_states | 2.000 s | 0.500 s | 16.00 MiB (16.00 MiB) |" in text
    assert "| 8.00 MiB | deterministic |" in text
    assert "bitwise equal True, 0 parameters differ" in text  # the control, as measured here
    figs = report.figures(result)
    assert set(figs) == {"rss_over_time", "agreement"}
    assert all(isinstance(f, Figure) for f in figs.values())
    assert len(figs["rss_over_time"].axes) == 2  # one panel per rank
    ax_time, ax_bytes = figs["agreement"].axes
    assert list(ax_time.lines[0].get_ydata()) == [2.0, 2.0]  # the slowest rank per size
    assert list(ax_bytes.lines[-1].get_ydata()) == [8 + 1024 / MiB, 16 + 1024 / MiB]  # theory


def test_options_keep_todays_spellings_and_errors_speak_in_flags():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, MetaInitConfig)
    args = parser.parse_args(["--model-mb", "16", "--sizes-mb", "16", "64", "--seed", "3", "--no-70b"])  # fmt: skip
    assert config_overrides(args, MetaInitConfig) == {
        "model_mb": 16,
        "sizes_mb": (16, 64),
        "seed": 3,
        "measure_70b": False,
    }
    assert config_overrides(parser.parse_args([]), MetaInitConfig) == {}
    with pytest.raises(ValueError) as err:
        MetaInitConfig(sizes_mb=(16, 0))
    assert str(err.value).startswith("sizes_mb=(16, 0) is out of range")
    flags = to_flags(str(err.value), MetaInitConfig)
    assert flags.startswith("--sizes-mb 16 0 is out of range") and flags.endswith(
        "Fix: --sizes-mb 16 64 256"
    )
