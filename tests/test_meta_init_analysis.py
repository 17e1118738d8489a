"""Lab 04 without a cluster: the analysis (per-rank figures regrouped, the slowest rank's time,
theory beside the measurements, verdicts over every size), the report built from it, and the
config's options as the command line spells them."""

from __future__ import annotations

import argparse
import json

import pytest
from matplotlib.figure import Figure
from meta_init_results import PSI_70B, SEVENTY, materialise, measured, parent_init, size

from fsdp_lab import theory
from fsdp_lab.labs.contract import LabResult
from fsdp_lab.labs.options import add_config_arguments, config_overrides, to_flags
from fsdp_lab.meta_init.lab import MetaInitConfig, analysis, figures, report
from fsdp_lab.meta_init.lab.config import CONTROL, MODES, PARENT_INIT

MiB = 2**20


def test_materialisation_regroups_per_rank_and_sets_the_theory_beside():
    memory = analysis.materialisation(materialise(n=2))
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
    four = analysis.materialisation(materialise(n=4))["theory_peak_bytes"]
    assert four["meta_shard_init"] == 2 * MiB  # the ranks are counted from the runs


@pytest.mark.parametrize("n", [1, 2, 3])
def test_agreement_row_takes_the_slowest_rank_and_the_broadcast_theory(n):
    row = analysis.agreement_row(size(16, n=n, wrong={"deterministic": ["output.weight"]}))
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


def test_agreement_figures_are_the_largest_size_and_verdicts_everysize():
    sizes = [size(8, wrong={"deterministic": ["x"]}, control=True), size(16)]
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
    data = analysis.analyse(config, measured())
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
    without = analysis.analyse(config, measured(seventy=None))
    assert without["seventy_b"] is None and without["parameters_70b"] is None


def test_parent_init_takes_every_rank_s_mismatches_once():
    data = analysis.parent_init(parent_init(recipe_wrong=["b", "a"], n=3))
    assert list(data) == list(PARENT_INIT)
    recipe = data["owners_only"]
    assert recipe["mismatched"] == ["a", "b"] and recipe["ranks_that_differ"] == [1]
    assert recipe["bitwise_equal_to_one_process"] is False and recipe["parameter_names"] == 53
    for how in ("param_init_fn", "torchtitan"):
        assert data[how]["bitwise_equal_to_one_process"] is True and data[how]["mismatched"] == []
    analysed = analysis.analyse(MetaInitConfig(), measured())["parent_init"]
    assert analysed == analysis.parent_init(parent_init())
    old = measured()
    del old["parent_init"]  # a result saved before the parent-init test existed
    assert analysis.analyse(MetaInitConfig(), old)["parent_init"] is None


def test_summary_and_figures_from_an_analysed_result():
    result = LabResult("meta-init", analysis.analyse(MetaInitConfig(), measured()))
    text = report.summary(result)
    assert f"| parameters (a tied one once) | {PSI_70B:,} |" in text
    assert "| ordinary build, then shard | 1.00 MiB |" in text  # rank 0's growth
    assert "(12.00 MiB)" in text  # the ordinary build's theory peak
    assert "| 16.00 MiB | sync_module_states | 2.000 s | 0.500 s | 16.00 MiB (16.00 MiB) |" in text
    assert "| 8.00 MiB | deterministic |" in text
    # The control, as measured here: it matched (the builders' control has no mismatch).
    assert f"the control ({CONTROL}: no broadcast) **also** matched the reference" in text
    assert "The recipe's claim fails here: on rank 1, 2 of 53 parameters" in text
    figs = figures(result)
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
