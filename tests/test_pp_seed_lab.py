"""Lab 05: the seed checkpoint and RNG replay equal the unsplit init bitwise and train like one
process; the same seed on every stage repeats stage 0's draws; per-stage seeds are distinct but
not the unsplit init; bytes and memory are what each strategy must cost; pp x dp replicas agree."""

from __future__ import annotations

import json
import math

import pytest
import torch
from matplotlib.figure import Figure

from fsdp_lab import rank, reference, world_size
from fsdp_lab.diagrams import Diagram
from fsdp_lab.pipeline import PipeGPT, lab, stage_info
from fsdp_lab.pipeline.lab import convergence
from fsdp_lab.pipeline.rng import STRATEGIES, init_stage

CONFIG = lab.PPSeedConfig(stages=2, layers=4, steps=8, grow_dims=(32, 64))
EXACT = ("seed_checkpoint", "rng_replay")  # (a), (d): the unsplit init, bitwise
OTHER = ("same_seed", "per_stage_seed")  # (b), (c): not the unsplit init
STATE_BYTES = torch.get_rng_state().numel()  # the CPU generator state a handoff sends


@pytest.fixture(scope="module")
def result(cluster_of):
    return lab.run(CONFIG, cluster=cluster_of(2))


@pytest.fixture(scope="module")
def mesh(cluster_of):
    """pp x dp on 4 ranks: S = 2 stages, 2 pipelines side by side."""
    return lab.run(
        lab.PPSeedConfig(stages=2, world_size=4, layers=4, steps=3, grow_dims=()),
        cluster=cluster_of(4),
    )


@pytest.fixture(scope="module")
def four_stages(cluster_of):
    config = lab.PPSeedConfig(stages=4, layers=4, steps=2, strategies=OTHER, grow_dims=())
    return lab.run(config, cluster=cluster_of(4))


@pytest.fixture(scope="module")
def scaled(cluster_of):
    """Init timed on 1 and 2 ranks (a fresh 1-rank cluster, the lab's own 2), and the
    convergence trainings spread over the 2 ranks."""
    config = lab.PPSeedConfig(
        stages=2, layers=4, steps=2, strategies=("rng_replay",), grow_dims=(), repeats=2,
        scale_ranks=(1, 2), scale_dim=32, convergence_seeds=2, convergence_steps=4,
    )  # fmt: skip
    return lab.run(config, cluster=cluster_of(2))


def _full_bytes(config: lab.PPSeedConfig, dim: int | None = None) -> int:
    with torch.device("meta"):
        return sum(p.numel() * 4 for p in PipeGPT(config.gpt(dim)).parameters())


def _single_process_losses(config: lab.PPSeedConfig) -> list[float]:
    model = PipeGPT(config.gpt())
    torch.manual_seed(config.seed)
    model.init_weights()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return reference.train_steps(
        model, opt, config.steps, global_batch=config.global_batch, seq_len=config.seq_len
    )


def test_json_has_the_issue_keys_per_strategy(result):
    data = json.loads(result.to_json())
    assert data["lab"] == "pp-seed" and data["stages"] == 2 and data["dp"] == 1
    assert list(data["strategies"]) == list(STRATEGIES)
    for row in data["strategies"].values():
        for key in ("bitwise_equal", "max_abs_diff", "init_time_s", "bytes_moved", "final_loss"):
            assert key in row, key
        assert len(row["peak_bytes_per_rank"]) == 2 and row["init_time_s"] > 0
    assert data["full_model_bytes"] == _full_bytes(CONFIG)


def test_checkpoint_and_replay_equal_the_unsplit_init_the_others_do_not(result):
    rows = result["strategies"]
    for s in EXACT:
        assert rows[s]["bitwise_equal"] is True and rows[s]["max_abs_diff"] == 0.0, s
    for s in OTHER:
        assert rows[s]["bitwise_equal"] is False, s
        assert rows[s]["max_abs_diff"] > 0.01 and rows[s]["mismatched_parameters"] > 0, s


def test_bytes_each_strategy_moves(result):
    rows = result["strategies"]
    # (d): one generator state per change of owner, S - 1 = 1 handoff, sent by stage 0.
    assert result["generator_state_bytes"] == STATE_BYTES and result["handoffs"] == 1
    assert rows["rng_replay"]["bytes_moved"] == 1 * STATE_BYTES
    assert rows["rng_replay"]["bytes_moved_per_rank"] == [STATE_BYTES, 0]
    assert rows["rng_replay"]["theory_bytes_moved"] == rows["rng_replay"]["bytes_moved"]
    assert rows["same_seed"]["bytes_moved"] == 0 and rows["same_seed"]["messages"] == 0
    # (c): S int64 seeds broadcast (counted on each rank); (a): "the file is there", 8 bytes.
    assert rows["per_stage_seed"]["bytes_moved_per_rank"] == [2 * 8, 2 * 8]
    assert rows["seed_checkpoint"]["bytes_moved_per_rank"] == [8, 8]
    assert rows["seed_checkpoint"]["checkpoint_file_bytes"] > result["full_model_bytes"]


def test_seed_checkpoint_needs_the_whole_model_on_rank_0_only(result):
    full = result["full_model_bytes"]
    peaks = result["strategies"]["seed_checkpoint"]["peak_bytes_per_rank"]
    assert peaks[0] >= full > peaks[1]
    replay = result["strategies"]["rng_replay"]["peak_bytes_per_rank"]
    assert max(replay) < full  # no rank ever builds the whole model
    for row, dim in zip(result["growth"], CONFIG.grow_dims, strict=True):
        assert row["full_model_bytes"] == _full_bytes(CONFIG, dim)
        grown = row["seed_checkpoint"]["peak_bytes_per_rank"]
        assert grown[0] >= row["full_model_bytes"] > grown[1], dim
        assert max(row["rng_replay"]["peak_bytes_per_rank"]) < row["full_model_bytes"] / 1.5
    small, large = (r["seed_checkpoint"]["peak_bytes_per_rank"][0] for r in result["growth"])
    assert large > 3 * small  # it grows with the model (dim 32 -> 64: about 4x)


def test_checkpoint_and_replay_train_exactly_like_one_process(result):
    expected = _single_process_losses(CONFIG)
    torch.testing.assert_close(result["baseline"]["losses"], expected, rtol=1e-6, atol=0)
    for s in EXACT:
        row = result["strategies"][s]
        torch.testing.assert_close(row["losses"], expected, rtol=1e-5, atol=0, msg=s)
        assert row["loss_matches_baseline"] is True
    for s in OTHER:
        row = result["strategies"][s]
        rel = max(abs(a - b) / b for a, b in zip(row["losses"], expected, strict=True))
        assert rel > 1e-4 and row["loss_matches_baseline"] is False, s


def test_same_seed_repeats_stage_0s_draws(result):
    same = result["strategies"]["same_seed"]["overlap"]
    # Stage 1 (layers 2, 3 and the head) drew exactly the first values stage 0 drew ...
    stage1_draws = 2 * (3 * 32 * 32 + 32 * 32 + 2 * 4 * 32 * 32) + 32 * 64
    assert same["shared_prefix_values_0_1"] == stage1_draws
    assert same["duplicate_fraction_per_stage"] == [None, 1.0] and same["stages_distinct"] is False
    # ... yet its first layer, set beside stage 0's layer 0, is uncorrelated (not the same place).
    assert abs(same["first_layer_corr_0_1"]) < 0.1
    for s in ("seed_checkpoint", "per_stage_seed", "rng_replay"):
        o = result["strategies"][s]["overlap"]
        assert o["shared_prefix_values_0_1"] == 0 and o["stages_distinct"] is True, s
        assert o["duplicate_fraction"] < 0.01 and o["repeated_pair_fraction_per_stage"] == [None, 0]


def test_with_three_or_more_stages_later_first_layers_are_identical(four_stages):
    same = four_stages["strategies"]["same_seed"]["overlap"]
    assert same["first_layer_corr_1_2"] == pytest.approx(1.0, abs=1e-12)
    assert same["identical_first_layers"] == [[1, 2], [1, 3], [2, 3]]
    assert same["duplicate_fraction_per_stage"] == [None, 1.0, 1.0, 1.0]
    per = four_stages["strategies"]["per_stage_seed"]["overlap"]
    assert abs(per["first_layer_corr_1_2"]) < 0.1 and per["identical_first_layers"] == []
    assert per["stages_distinct"] is True


def test_pp_by_dp_replicas_agree_and_stages_differ(mesh):
    assert mesh["world_size"] == 4 and mesh["dp"] == 2 and mesh["stages"] == 2
    for s, row in mesh["strategies"].items():
        assert row["mesh"]["replicas_equal"] is True and row["mesh"]["replica_max_abs_diff"] == 0
        assert row["mesh"]["stages_distinct"] is (s != "same_seed"), s
        assert len(row["peak_bytes_per_rank"]) == 4
    replay = mesh["strategies"]["rng_replay"]
    assert replay["bytes_moved"] == 2 * 1 * STATE_BYTES  # one handoff in each pipeline
    assert replay["bytes_moved_per_rank"] == [STATE_BYTES, 0, STATE_BYTES, 0]
    expected = _single_process_losses(lab.PPSeedConfig(stages=2, world_size=4, layers=4, steps=3))
    for s in EXACT:  # the mean over the two pipelines is the single-process loss
        assert mesh["strategies"][s]["bitwise_equal"] is True
        torch.testing.assert_close(mesh["strategies"][s]["losses"], expected, rtol=1e-5, atol=0)


def test_figures_and_summary(result):
    figs = lab.figures(result)
    assert {f"pipeline_{s}" for s in STRATEGIES} | {"loss_curves", "growth", "growth_time"} <= set(
        figs
    )
    assert "same_seed_draws" in figs
    for name, fig in figs.items():
        assert isinstance(fig, Diagram if name.startswith("pipeline_") else Figure), name
    text = lab.summary(result)
    assert "| (d) rng_replay | yes | 0 |" in text and "| (b) same_seed | no |" in text
    assert f"generator state {STATE_BYTES:,} B; 1 change(s) of owner" in text


def test_layout_defaults():
    assert (lab.PPSeedConfig().stages, lab.PPSeedConfig().world_size) == (3, 3)
    assert (lab.PPSeedConfig(world_size=2).stages, lab.PPSeedConfig(stages=2).world_size) == (2, 2)
    assert lab.PPSeedConfig(stages=2, world_size=4).dp == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"stages": 5, "layers": 4},
            "stages=5 is out of range for layers=4: allowed 1..4 (every stage needs at least one "
            "layer). Fix: stages=4, or layers=5",
        ),
        (
            {"stages": 2, "world_size": 3},
            "stages=2 does not divide world_size=3: allowed stages in [1, 3]",
        ),
        ({"stages": 0}, "stages=0 is out of range: allowed an int >= 1"),
        (
            {"strategies": ("replay",)},
            "strategy 'replay' is unknown: allowed one or more of ['seed_ch",
        ),
        ({"strategies": ()}, "allowed one or more of"),
        ({"layers": 0}, "layers=0 is out of range: allowed an int from 1 to 256"),
        ({"steps": 0}, "steps=0 is out of range: allowed an int from 1 to 100,000"),
        ({"dim": 30, "heads": 4}, "dim=30 is not divisible by heads=4"),
        (
            {"stages": 2, "world_size": 4, "global_batch": 6},
            "global_batch=6 does not split into dp=2",
        ),
        (
            {"optimizer": "lion"},
            "optimizer='lion': expected one of ['sgd', 'adam']. Fix: optimizer='sgd'",
        ),
        ({"grow_dims": (30,)}, "grow_dims=(30,): width 30 is out of range"),
        (
            {"grow_dims": (31,), "dim": 48, "heads": 3},
            "Fix: grow_dims=(48, 96, 192)",
        ),  # one that works
        ({"world_size": 0}, "world_size=0 is out of range: allowed an int >= 1 (ranks, S x dp"),
        (
            {"vocab": 1},
            "vocab=1 is out of range: allowed an int from 2 to 1,048,576 (vocabulary size). Fix: vocab=64",
        ),
        ({"repeats": 0}, "repeats=0 is out of range: allowed an int from 1 to 100"),
        (
            {"scale_ranks": (1, 9), "layers": 4},
            "scale_ranks=(1, 9): 9 is out of range: allowed distinct ints in 1..4 (one pipeline "
            "stage per rank, at least one layer each), or none. Fix: scale_ranks=(1, 2, 3, 4)",
        ),
        ({"scale_ranks": (2, 2)}, "scale_ranks=(2, 2): a count appears twice"),
        (
            {"scale_dim": 30},
            "scale_dim=30 is out of range: allowed an int up to 8,192 divisible by heads=4",
        ),
        ({"scale_strategies": ("replay",)}, "scale_strategies=('replay',): strategy 'replay'"),
        (
            {"convergence_seeds": -1},
            "convergence_seeds=-1 is out of range: allowed an int from 0 to 100",
        ),
    ],
)
def test_bad_config_names_the_value_the_range_and_the_fix(kwargs, message):
    with pytest.raises(ValueError) as err:
        lab.PPSeedConfig(**kwargs)
    assert message in str(err.value) and "Fix:" in str(err.value)


def test_explorer_runs_on_a_borrowed_cluster_and_leaves_it_open(cluster_of):
    from fsdp_lab.pipeline.lab.explorer import PPSeedExplorer

    cluster = cluster_of(2)
    explorer = PPSeedExplorer(stages=2, layers=2, strategy="rng_replay", steps=2, cluster=cluster)
    explorer.show()
    row = explorer.last_result["strategies"]["rng_replay"]
    assert list(explorer.last_result["strategies"]) == ["rng_replay"]
    assert row["bitwise_equal"] is True and row["bytes_moved"] == STATE_BYTES
    explorer.layers.value = 1  # two stages, one layer: refused before any rank is asked
    explorer.last_result = None
    explorer.show()
    assert "stages=2 is out of range for layers=1" in explorer.slots.outputs[0].data
    assert explorer.last_result is None
    explorer.close()
    assert cluster.run(world_size) == [2, 2]  # the borrowed cluster is still open


def test_init_timed_on_one_and_two_ranks_costs_what_each_strategy_must(scaled):
    scaling = scaled["scaling"]
    assert scaling["strategies"] == ["seed_checkpoint", "per_stage_seed", "rng_replay"]
    one, two = scaling["rows"]
    assert (one["ranks"], two["ranks"]) == (1, 2) and scaling["dim"] == 32
    whole = _full_bytes(lab.PPSeedConfig(stages=2, layers=4), 32)
    assert scaling["full_model_bytes"] == whole
    for row in (one, two):
        for s in scaling["strategies"]:
            costs = row[s]
            assert len(costs["cpu_time_s_per_rank"]) == row["ranks"], s
            assert len(costs["init_time_s_runs"]) == 2 and costs["init_time_s"] > 0, s  # repeats
    # One stage: nothing to hand on; two: one generator state. The seeds: S int64 per rank.
    assert one["rng_replay"]["bytes_moved"] == 0 and two["rng_replay"]["bytes_moved"] == STATE_BYTES
    assert two["per_stage_seed"]["bytes_moved_per_rank"] == [2 * 8, 2 * 8]
    # The seed checkpoint: rank 0 builds the whole model however many ranks there are.
    assert one["seed_checkpoint"]["peak_bytes_per_rank"][0] >= whole
    ckpt = two["seed_checkpoint"]["peak_bytes_per_rank"]
    assert ckpt[0] >= whole > ckpt[1]
    assert set(scaling["trends"]) == set(scaling["strategies"])
    assert "on 1 and on 2 ranks" in lab.summary(scaled) or scaled["cores"] < 2


def test_convergence_trains_both_inits_at_every_seed(scaled):
    conv = scaled["convergence"]
    assert conv["seeds"] == [0, 1] and conv["steps"] == 4
    for init in ("unsplit", "same_seed"):
        assert [len(c) for c in conv["curves"][init]] == [4, 4], init
        for curve in conv["curves"][init]:
            assert abs(curve[0] - math.log(64)) < 0.1  # an untrained model guesses
    # The same data and the same stage 0: the two inits start from nearly the same loss, but
    # not the same one (later stages differ).
    assert conv["curves"]["unsplit"][0] != conv["curves"]["same_seed"][0]
    assert "2 seeds, 4 steps each" in lab.summary(scaled)


def test_the_same_seed_model_is_what_the_ranks_build(cluster_of):
    config = lab.PPSeedConfig(stages=2, layers=4)

    def same_seed_stage() -> dict:
        info = stage_info(rank(), 2, 2, 4)
        return init_stage("same_seed", config.gpt(), info, 0).state_dict()

    joined = convergence.initial_model(config, "same_seed", 0).state_dict()
    stages = cluster_of(2).run(same_seed_stage)
    assert set().union(*stages) == set(joined)
    for stage in stages:
        for name, value in stage.items():
            assert torch.equal(value, joined[name]), name


def test_scaling_beyond_the_labs_ranks_starts_a_cluster_of_that_size(cluster_of):
    config = lab.PPSeedConfig(
        stages=1, layers=2, steps=1, strategies=("rng_replay",), grow_dims=(), repeats=1,
        scale_ranks=(1, 2), scale_dim=32, scale_strategies=("rng_replay",),
    )  # fmt: skip
    result = lab.run(config, cluster=cluster_of(1))
    one, two = result["scaling"]["rows"]
    assert (
        len(one["rng_replay"]["cpu_time_s_per_rank"]) == 1 and one["rng_replay"]["bytes_moved"] == 0
    )
    assert len(two["rng_replay"]["cpu_time_s_per_rank"]) == 2
    assert two["rng_replay"]["bytes_moved"] == STATE_BYTES  # a real second rank, handed the state
