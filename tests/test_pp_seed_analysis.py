"""Lab 05's analysis and report without a cluster: what the ranks would return is built in this
process (the same-seed stages by `init_stage`, which sends nothing; the exact stages cut from the
unsplit init), and every verdict, sum, mean and table is checked against it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from matplotlib.figure import Figure

from fsdp_lab.diagrams import Diagram
from fsdp_lab.labs.contract import LabResult
from fsdp_lab.pipeline import PipeGPT, stage_info
from fsdp_lab.pipeline.lab import PPSeedConfig, analysis, figures, report
from fsdp_lab.pipeline.rng import init_stage, record_init_order
from fsdp_lab.sizes import format_bytes

STATE_BYTES = 5056  # a CPU generator state
STRATEGIES = ("same_seed", "rng_replay")
CONFIG = PPSeedConfig(stages=2, layers=4, steps=3, strategies=STRATEGIES, grow_dims=(32, 64))
# Stage 1 (layers 2, 3 and the head) draws, Linear by Linear: qkv, proj, fc, mlp.proj; head.
STAGE1_DRAWS = 2 * (3 * 32 * 32 + 32 * 32 + 2 * 4 * 32 * 32) + 32 * 64


def _reference(config: PPSeedConfig) -> dict[str, torch.Tensor]:
    model = PipeGPT(config.gpt())
    torch.manual_seed(config.seed)
    model.init_weights()
    return model.state_dict()


def _same_seed_stages(config: PPSeedConfig) -> list[dict[str, torch.Tensor]]:
    """Each stage initialised the buggy way, in this process (same_seed sends nothing)."""
    stages = []
    for s in range(config.stages):
        info = stage_info(s, config.stages, config.stages, config.layers)  # one pipeline
        stages.append(init_stage("same_seed", config.gpt(), info, config.seed).state_dict())
    return stages


def _cost(rank: int, stage: int) -> dict[str, Any]:
    # Made-up but distinct per rank and per repeat, so that a max, a median, a sum or a
    # per-rank list can be told apart: two repeats, t and 3t, median 2t; CPU t/2 each time.
    sent = float(STATE_BYTES) if stage == 0 else 0.0  # rng_replay: stage 0 hands on, once
    t = 0.1 * (rank + 1)
    return {
        "init_time_s": 2 * t,
        "init_time_s_runs": [t, 3 * t],
        "cpu_time_s": t / 2,
        "cpu_time_s_runs": [t / 2, t / 2],
        "peak_bytes": 1000 + rank,
        "bytes_moved": sent,
        "messages": 1,
    }


def _measured(config: PPSeedConfig, world_size: int, losses: dict[str, list[list[float]]]) -> dict:
    """What `measure` returns for `world_size` ranks: losses[strategy][pipeline] per step."""
    ref, same = _reference(config), _same_seed_stages(config)
    per_rank = []
    for r in range(world_size):
        stage, dp_rank = r % config.stages, r // config.stages
        params = {"same_seed": same[stage], "rng_replay": {k: ref[k] for k in same[stage]}}
        row = {"rank": r, "stage": stage, "dp_rank": dp_rank}
        for s in STRATEGIES:
            row[s] = {"init": _cost(r, stage), "params": params[s], "losses": losses[s][dp_rank]}
        row["growth"] = [{s: _cost(r, stage) for s in STRATEGIES} for _ in config.grow_dims]
        row["generator_state_bytes"] = STATE_BYTES
        row["first_call_s"] = dict.fromkeys(STRATEGIES, 0.5)
        row["baseline"] = {"params": ref, "losses": BASELINE} if r == 0 else None
        per_rank.append(row)
    return {"world_size": world_size, "backend": "gloo", "cores": 2, "per_rank": per_rank}


BASELINE = [4.0, 3.5, 3.0]
LOSSES = {"rng_replay": [[x * (1 + 1e-7) for x in BASELINE]], "same_seed": [[4.1, 3.6, 3.1]]}


@pytest.fixture(scope="module")
def result() -> LabResult:
    return LabResult("pp-seed", analysis.analyse(CONFIG, _measured(CONFIG, 2, LOSSES)))


def test_the_json_has_the_labs_keys(result):
    assert set(result.data) == {
        "config", "world_size", "stages", "dp", "backend", "model", "full_model_bytes",
        "generator_state_bytes", "handoffs", "layers_per_stage", "strategies", "baseline", "growth",
        "growth_timing", "cores", "repeats", "scaling", "convergence", "first_call",
    }  # fmt: skip
    # The first calls (0.5 s, made up) against the measured median of 0.4 s.
    assert result["first_call"]["rng_replay"]["ratio"] == pytest.approx(0.5 / 0.4)
    assert result["scaling"] is None and result["convergence"] is None  # not asked for
    assert result["layers_per_stage"] == [[0, 1], [2, 3]] and result["handoffs"] == 1
    full = sum(v.numel() * 4 for v in _reference(CONFIG).values())
    assert result["full_model_bytes"] == full and result["config"]["dp"] == 1


def test_replay_equals_the_unsplit_init_and_same_seed_does_not(result):
    replay, same = result["strategies"]["rng_replay"], result["strategies"]["same_seed"]
    assert replay["bitwise_equal"] is True and replay["max_abs_diff"] == 0.0
    assert replay["mismatched_parameters"] == 0 and replay["first_mismatched"] == []
    # Stage 0 reads the stream as the unsplit init does; stage 1's 9 drawn weights do not
    # (its LayerNorm ones and zero biases draw nothing, so they are right by construction).
    assert same["bitwise_equal"] is False and same["mismatched_parameters"] == 9
    assert same["first_mismatched"] == ["head.weight", "layers.2.attn.proj.weight",
                                        "layers.2.attn.qkv.weight"]  # fmt: skip
    assert same["max_abs_diff"] > 0.01


def test_costs_are_the_slowest_rank_and_the_sum_of_bytes(result):
    row = result["strategies"]["rng_replay"]
    # Each repeat's pipeline time is its slowest rank's (0.2, then 0.6); the median is kept.
    assert row["init_time_s_runs"] == pytest.approx([0.2, 0.6])
    assert row["init_time_s"] == pytest.approx(0.4)
    assert row["init_time_s_per_rank"] == pytest.approx([0.2, 0.4])
    assert row["cpu_time_s_per_rank"] == pytest.approx([0.05, 0.1])
    assert row["peak_bytes_per_rank"] == [1000, 1001] and row["messages"] == 2
    assert row["bytes_moved"] == STATE_BYTES and row["bytes_moved_per_rank"] == [STATE_BYTES, 0]
    assert all(type(b) is int for b in [row["bytes_moved"], *row["bytes_moved_per_rank"]])
    assert row["theory_bytes_moved"] == 1 * STATE_BYTES * 1  # handoffs x state x pipelines
    assert "theory_bytes_moved" not in result["strategies"]["same_seed"]


def test_losses_against_single_process_training(result):
    replay, same = result["strategies"]["rng_replay"], result["strategies"]["same_seed"]
    assert replay["loss_matches_baseline"] is True and replay["loss_max_rel_diff"] < 1e-6
    assert same["loss_matches_baseline"] is False
    assert same["loss_max_rel_diff"] == pytest.approx(0.1 / 3.0)  # the last step's, the largest
    assert same["final_loss"] == 3.1 and result["baseline"]["final_loss"] == 3.0


def test_growth_rows_count_the_whole_model_and_keep_three_costs(result):
    for row, dim in zip(result["growth"], (32, 64), strict=True):
        with torch.device("meta"):
            n = sum(p.numel() for p in PipeGPT(CONFIG.gpt(dim)).parameters())
        assert (row["dim"], row["parameters"], row["full_model_bytes"]) == (dim, n, 4 * n)
        for s in STRATEGIES:
            assert set(row[s]) == {
                "peak_bytes_per_rank", "init_time_s", "init_time_s_runs", "init_time_s_per_rank",
                "cpu_time_s_per_rank", "cpu_time_s_runs", "bytes_moved",
            }  # fmt: skip
            assert row[s]["peak_bytes_per_rank"] == [1000, 1001]


def test_same_seed_repeats_stage_0s_draws_replay_does_not(result):
    same = result["strategies"]["same_seed"]["overlap"]
    assert same["shared_prefix_values_0_1"] == STAGE1_DRAWS
    assert same["duplicate_fraction_per_stage"] == [None, 1.0] and same["stages_distinct"] is False
    assert abs(same["first_layer_corr_0_1"]) < 0.1  # aligned layers look unrelated
    assert len(same["samples"]["stage1_stream"]) == analysis.SAMPLE
    replay = result["strategies"]["rng_replay"]["overlap"]
    assert replay["shared_prefix_values_0_1"] == 0 and replay["stages_distinct"] is True
    assert replay["repeated_pair_fraction_per_stage"] == [None, 0.0]
    assert result["strategies"]["same_seed"]["mesh"] == {
        "replicas_equal": None, "replica_max_abs_diff": None, "stages_distinct": False
    }  # fmt: skip


def test_pp_by_dp_averages_the_pipelines_and_compares_the_replicas():
    # The config asked for 2 ranks; the cluster had 4: its size wins, so 2 pipelines.
    losses = {
        "rng_replay": [[x * 1.01 for x in BASELINE], [x * 0.99 for x in BASELINE]],
        "same_seed": [BASELINE, BASELINE],
    }
    measured = _measured(CONFIG, 4, losses)
    nudged = measured["per_rank"][3]["same_seed"]["params"]  # stage 1 of pipeline 1
    measured["per_rank"][3]["same_seed"]["params"] = {k: v.clone() for k, v in nudged.items()}
    measured["per_rank"][3]["same_seed"]["params"]["head.weight"][0, 0] += 0.5
    out = analysis.analyse(CONFIG, measured)
    assert (out["world_size"], out["dp"]) == (4, 2)
    replay, same = out["strategies"]["rng_replay"], out["strategies"]["same_seed"]
    assert replay["losses"] == pytest.approx(BASELINE, rel=1e-12)  # the mean of the pipelines
    assert replay["mesh"]["replicas_equal"] is True and replay["mesh"]["replica_max_abs_diff"] == 0
    assert same["mesh"]["replicas_equal"] is False
    assert same["mesh"]["replica_max_abs_diff"] == pytest.approx(0.5, abs=1e-6)
    assert replay["theory_bytes_moved"] == 2 * STATE_BYTES == replay["bytes_moved"]


def test_comparisons_catch_a_single_changed_value():
    ref = {"w": torch.tensor([1.0, 2.0, 3.0])}
    nudged = {"w": torch.tensor([1.0, 2.0, 3.0 + 2**-22])}
    assert analysis.compare_with_reference([ref], ref)["bitwise_equal"] is True
    bad = analysis.compare_with_reference([ref, nudged], ref)
    # One float32 ulp at 3.0: the float32 difference is exact (the two are within a factor 2).
    assert bad["bitwise_equal"] is False and bad["max_abs_diff"] == 2**-22
    assert analysis.replica_check([ref, ref], [0, 0])["replicas_equal"] is True
    assert analysis.replica_check([ref, nudged], [0, 0])["replicas_equal"] is False
    assert analysis.replica_check([ref, nudged], [0, 1])["replicas_equal"] is None  # dp = 1
    with pytest.raises(ValueError, match="do not hold the whole model"):
        analysis.compare_with_reference([{}], ref)


def test_handoffs_count_the_owner_changes_of_the_recorded_order():
    config = PPSeedConfig(stages=3, layers=6)
    with torch.device("meta"):
        order = record_init_order(PipeGPT(config.gpt()))
    assert order[0] == "tok_emb" and order[-1] == "head"
    assert analysis.handoffs(config) == 2
    assert analysis.handoffs(PPSeedConfig(stages=1, layers=6)) == 0


def test_with_three_or_more_stages_later_first_layers_are_identical():
    config = PPSeedConfig(stages=4, layers=4)
    stages = dict(enumerate(_same_seed_stages(config)))
    over = analysis.stage_overlap(config.gpt(), stages)
    assert over["first_layer_corr_1_2"] == pytest.approx(1.0, abs=1e-12)
    assert over["identical_first_layers"] == [[1, 2], [1, 3], [2, 3]]
    assert over["duplicate_fraction_per_stage"] == [None, 1.0, 1.0, 1.0]
    alone = analysis.stage_overlap(config.gpt(), {0: _reference(config)})
    assert alone["stages_distinct"] is None and alone["samples"] == {}  # nothing to compare


def test_tables_and_summary_say_what_was_measured(result):
    text = report.summary(result)
    assert "S = 2 stages x dp = 1 pipeline(s) on 2 ranks (gloo); layers per stage 0-1, 2-3" in text
    assert f"generator state {STATE_BYTES:,} B; 1 change(s) of owner" in text
    assert "median of 3 repeat(s)" in text
    assert "| (d) rng_replay | yes | 0 | 1000 B | 1001 B | 400.0 ms | 5,056 B | 2 |" in text
    assert "| (b) same_seed | no |" in text
    overlap = report.overlap_table(result).splitlines()[-2]  # (b): rows follow the strategies
    cells = [c.strip() for c in overlap.split("|")[1:-1]]
    # corr 1-2 needs 3 stages; no identical first layers with 2; the shared prefix; every value
    # of stage 1 repeats stage 0's; not distinct; no replicas at dp = 1.
    assert cells[0] == "(b) same_seed" and cells[2:] == [
        "-", "none", f"{STAGE1_DRAWS:,}", "1.00e+00", "False", "-"
    ]  # fmt: skip
    full = format_bytes(result["growth"][0]["full_model_bytes"])
    assert f"| 32 | {full} | 1000 B / 1001 B, 400.0 ms | 1000 B / 1001 B, 400.0 ms |" in text


def test_figures_by_stem(result):
    figs = figures(result)
    assert set(figs) == {
        "pipeline_same_seed", "pipeline_rng_replay", "loss_curves", "growth", "growth_time",
        "same_seed_draws",
    }  # fmt: skip
    for name, fig in figs.items():
        assert isinstance(fig, Diagram if name.startswith("pipeline_") else Figure), name
    # No growth measured and no same_seed run: those pictures are left out, not drawn empty.
    lean = PPSeedConfig(stages=2, layers=4, steps=3, strategies=("rng_replay",), grow_dims=())
    losses = {"rng_replay": [BASELINE], "same_seed": [BASELINE]}
    measured = _measured(lean, 2, losses)
    data = analysis.analyse(lean, measured)
    assert set(figures(LabResult("pp-seed", data))) == {
        "pipeline_rng_replay",
        "loss_curves",
    }
