"""Lab 02: every schedule measured, equal gradients, counts equal theory, torch comparison."""

from __future__ import annotations

import pytest

from fsdp_lab.checkpointing import lab


def test_lab_measures_every_schedule_and_matches_torch(cluster_of):
    config = lab.CheckpointConfig(layers=(8, 16), dim=32, batch=16, world_size=2)
    result = lab.run(config, cluster=cluster_of(2))
    for n, chain in result["chains"].items():
        rows = {r["schedule"].split("(")[0]: r for r in chain["rows"]}
        assert set(rows) == {
            "store_all",
            "full_recompute",
            "every",
            "segments",
            "optimal",
            "revolve",
        }
        for r in chain["rows"]:
            assert r["max_abs_grad_diff"] == 0.0, r  # recomputation is bitwise the same
            assert r["forward_calls"] == r["theory_forward_calls"]
            assert r["stored_activations"] == r["theory_stored_activations"]
        n = int(n)
        assert rows["store_all"]["forward_calls"] == n
        assert rows["full_recompute"]["forward_calls"] == n * (n + 1) // 2
        # Memory and compute trade off as the table says, measured by the tracker.
        assert (
            rows["store_all"]["peak_activation_bytes"] > rows["segments"]["peak_activation_bytes"]
        )
        assert (
            rows["segments"]["peak_activation_bytes"]
            > rows["full_recompute"]["peak_activation_bytes"]
        )
        # revolve(b - 1) keeps as many inputs as optimal(b), and follows the binomial law.
        theirs = rows["revolve"]
        assert theirs["stored_activations"] == rows["optimal"]["stored_activations"]
        assert theirs["repetitions"] == theirs["theory_repetitions"]
        assert theirs["forward_calls"] == n + theirs["advances"]
        # Timing: a median inside the range of its repeats (no wall time asserted).
        assert all(r["time_min_s"] <= r["time_s"] <= r["time_max_s"] for r in chain["rows"])
        # The optimal schedule is on the frontier: no other schedule with at most its memory
        # (in kept layer inputs) makes fewer calls.
        best = rows["optimal"]
        for r in chain["rows"]:
            if r["stored_activations"] <= best["stored_activations"]:
                assert best["forward_calls"] <= r["forward_calls"], r
        versus = chain["versus_torch"]
        assert versus["max_abs_grad_diff_ours_vs_torch"] == 0.0
        assert versus["peak_ratio_ours_to_torch"] == pytest.approx(1.0, abs=0.05)
        assert versus["ours_peak_activation_bytes"] < versus["store_all_peak_activation_bytes"]
    sharding = result["with_sharding"]
    assert (
        sharding["checkpoint_spans_two_units"]["all_gather_bytes_per_step"]
        > sharding["plain"]["all_gather_bytes_per_step"]
    )
    assert (
        sharding["unit_wraps_checkpoint"]["all_gather_bytes_per_step"]
        == sharding["plain"]["all_gather_bytes_per_step"]
    )
    assert all(s["max_abs_param_diff_vs_plain"] == 0.0 for s in sharding.values())
    assert all(
        s["all_gather_calls_per_step"] == s["theory_all_gather_calls_per_step"]
        for s in sharding.values()
    )
    assert set(result["schedules"]["8"]["store_all"]) == {
        "peak_activation_bytes",
        "forward_calls",
        "time_s",
        "max_abs_grad_diff",
    }
    # The recorded runs drawn over time are the table's: their peaks are the rows' peaks.
    first = {r["schedule"]: r for r in result["chains"]["8"]["rows"]}
    assert set(result["memory_traces"]) == {"store_all", "segments(3)"}
    for name, trace in result["memory_traces"].items():
        assert max(trace["bytes"]["activations"]) == first[name]["peak_activation_bytes"]
        assert trace["peak_bytes"] == first[name]["peak_total_bytes"]
        assert {m["label"] for m in trace["markers"]} >= {"L0", "L7"}
    assert all(
        row["at"]["repetitions"] == row["repetitions"] < row["past"]["repetitions"]
        for row in result["binomial_law"]
    )
    assert "memory_vs_compute" in lab.figures(result)
    assert "| store_all |" in lab.summary(result)


@pytest.mark.parametrize(
    "kwargs, message, fix",
    [
        ({"layers": (8,), "every": 0}, "every=0 is out of range: allowed 1..8", "every=1"),
        ({"layers": (8, 16), "segment": 9}, "segment=9 is out of range: allowed 1..8", "segment=8"),
        ({"layers": (8,), "budget": 1}, "budget=1 is out of range: allowed 2..8", "budget=2"),
        (
            {"layers": (8,), "snapshots": 9},
            "snapshots=9 is out of range: allowed 1..8",
            "snapshots=8",
        ),
        ({"layers": (8,), "every": 2.5}, "every=2.5 is out of range", "every=3"),
        ({"layers": (0, 4)}, "layers=(0, 4): expected chain lengths", "layers=(4,)"),
    ],
)
def test_bad_config_names_the_value_the_range_and_the_fix(kwargs, message, fix):
    with pytest.raises(ValueError) as err:
        lab.CheckpointConfig(**kwargs)
    assert str(err.value).startswith(message) and str(err.value).endswith(f"Fix: {fix}")


def test_one_rank_gathers_nothing_and_the_theory_says_so(cluster_of):
    # Found on an H100 (`Cluster(1, backend="nccl")`), the same on gloo: the lab read the
    # all-gather count of a log that has none on one rank, and raised KeyError.
    config = lab.CheckpointConfig(layers=(4,), dim=8, batch=4, world_size=1)
    result = lab.run(config, cluster=cluster_of(1))
    for mode, s in result["with_sharding"].items():
        assert s["all_gather_calls_per_step"] == s["theory_all_gather_calls_per_step"] == 0, mode
        assert s["max_abs_param_diff_vs_plain"] == 0.0
    assert "differ from their theory" not in lab.summary(result)
