"""Lab 05's sentences, each fed results that go each way: the course-note claims (init time
over ranks, same seed and convergence), the init-time hump, and every comparison the notebook
states about the four strategies. Also the learnable task's floor, the docs/labs.md table (nothing
in it moves between runs) and the figures (no series hidden under another). No ranks here."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from matplotlib.figure import Figure

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.pipeline.lab import PPSeedConfig, convergence, report
from fsdp_lab.pipeline.lab.figures import growth_figure, growth_time_figure, scaling_figure
from fsdp_lab.pipeline.lab.timing import first_calls, growth_timing, init_costs, scaling_rows, trend

SCALED = ("seed_checkpoint", "per_stage_seed", "rng_replay")


# -- init time on 1, 2, ... ranks: "exact seeding makes init O(1) in the number of nodes" ------


def _init(wall: float, cpu: float) -> dict:
    return {
        "init_time_s": wall,
        "init_time_s_runs": [wall * 0.9, wall, wall * 1.2],
        "cpu_time_s": cpu,
        "cpu_time_s_runs": [cpu, cpu, cpu],
        "peak_bytes": 100,
        "bytes_moved": 0.0,
        "messages": 0,
    }


def _scaling_result(wall: dict[str, list[float]], cores: int | None = 4) -> LabResult:
    """Made-up scaling: wall[strategy][i] is every rank's wall time on ranks = i + 1; CPU time
    falls as 1/ranks (each rank draws its share)."""
    config = PPSeedConfig(stages=4, layers=4, scale_ranks=(1, 2, 3, 4), grow_dims=())
    measured = [
        {
            "ranks": n,
            "per_rank": [{s: _init(wall[s][n - 1], 0.1 / n) for s in SCALED} for _ in range(n)],
        }
        for n in config.scale_ranks
    ]
    scaling = scaling_rows(config, measured, cores) | {"full_model_bytes": 4096}
    return LabResult("pp-seed", {"scaling": scaling, "cores": cores})


def test_init_costs_take_the_slowest_rank_of_each_repeat_then_the_median():
    a = _init(1.0, 0.5) | {"init_time_s_runs": [1.0, 5.0, 2.0]}
    b = _init(1.0, 0.5) | {"init_time_s_runs": [3.0, 1.0, 1.0]}
    costs = init_costs([a, b])
    assert costs["init_time_s_runs"] == [3.0, 5.0, 2.0] and costs["init_time_s"] == 3.0
    runs = [1.0, 1.0, 1.0]
    assert trend(runs, [1.3] * 3) == "grows" and trend(runs, [0.7] * 3) == "falls"
    assert trend(runs, [1.05] * 3) == "flat"  # within the margin
    # The median moved by half, but one repeat of each lies inside the other's range: noise.
    assert trend([1.0, 1.0, 2.0], [1.5, 1.5, 1.6]) == "flat"
    assert trend([1.0, 1.1, 1.2], [1.5, 1.5, 1.6]) == "grows"


def test_scaling_sentence_says_the_claim_holds_when_the_exact_inits_stay_flat():
    flat = {s: [0.10, 0.11, 0.10, 0.11] for s in SCALED} | {
        "per_stage_seed": [0.1, 0.07, 0.05, 0.04]
    }
    result = _scaling_result(flat)
    text = report.scaling_sentence(result)
    assert "The claim holds for (d) rng_replay here" in text  # exact seeding: (d) only
    assert "(a) seed_checkpoint here" not in text  # (a) is sync, not exact seeding
    assert "nor did it fall" in text and "fails" not in text
    assert "(c) per_stage_seed 100.0 ms -> 40.0 ms (fell, 0.40x)" in text
    assert "(d) rng_replay 0.25x (all ranks together 1.00x)" in text  # CPU: 1/n each, n ranks
    assert "share" not in text  # 4 ranks on 4 cores: nothing left unjudged


def test_scaling_sentence_says_the_claim_fails_when_an_exact_init_grows():
    wall = {s: [0.10, 0.11, 0.10, 0.11] for s in SCALED} | {"rng_replay": [0.1, 0.15, 0.2, 0.3]}
    text = report.scaling_sentence(_scaling_result(wall))
    assert "The claim fails for (d) rng_replay: its init time grew with the ranks (3.00x)" in text
    assert "The claim holds" not in text  # (a) stayed flat, but it is sync: it does not count


def test_scaling_counts_no_growth_inside_the_spread_of_the_repeats():
    wall = {s: [0.10, 0.11, 0.10, 0.11] for s in SCALED} | {"rng_replay": [0.1, 0.15, 0.2, 0.3]}
    assert _scaling_result(wall)["scaling"]["trends"]["rng_replay"]["wall"] == "grows"
    # The same medians, but one repeat on 1 rank was slower than every repeat on 4: noise.
    config = PPSeedConfig(stages=4, layers=4, scale_ranks=(1, 4), grow_dims=())
    measured = [
        {"ranks": n, "per_rank": [{s: _init(wall[s][n - 1], 0.1) for s in SCALED}] * n}
        for n in (1, 4)
    ]
    measured[0]["per_rank"][0]["rng_replay"]["init_time_s_runs"] = [0.09, 0.1, 0.4]
    noisy = LabResult("pp-seed", {"scaling": scaling_rows(config, measured, 4), "cores": 4})
    assert noisy["scaling"]["trends"]["rng_replay"]["wall"] == "flat"
    text = report.scaling_sentence(noisy)
    assert "The claim holds for (d) rng_replay here" in text


def test_scaling_judges_wall_time_only_where_every_rank_had_a_core():
    # On 2 cores, 3 and 4 ranks take turns: their (made-up, huge) times must not decide.
    wall = {s: [0.10, 0.11, 0.5, 0.9] for s in SCALED}
    result = _scaling_result(wall, cores=2)
    assert result["scaling"]["judged_ranks"] == [1, 2]
    text = report.scaling_sentence(result)
    assert "on 1 and on 2 ranks" in text and "The claim holds for" in text
    assert "Above 2 ranks the ranks share 2 cores" in text
    on_four = report.scaling_sentence(_scaling_result(wall, cores=4))
    assert "The claim fails for (d) rng_replay" in on_four


def test_scaling_on_one_rank_count_has_no_trend():
    config = PPSeedConfig(stages=1, layers=4, scale_ranks=(1,), grow_dims=())
    rows = scaling_rows(
        config, [{"ranks": 1, "per_rank": [{s: _init(0.1, 0.1) for s in SCALED}]}], 2
    )
    text = report.scaling_sentence(LabResult("pp-seed", {"scaling": rows, "cores": 2}))
    assert text.startswith("Measured on one number of ranks only")


# -- the init-time hump as the model grows --------------------------------------------------------


def _growth_result(wall: list[float], cpu: list[float], spread: float = 1.2) -> LabResult:
    config = PPSeedConfig(stages=2, layers=4, strategies=("rng_replay",), grow_dims=(32, 64, 128))
    growth = [
        {
            "dim": d,
            "rng_replay": {
                "init_time_s": w,
                "init_time_s_runs": [w, w * spread],
                "cpu_time_s_per_rank": [c, c / 2],
                "cpu_time_s_runs": [c, c],
            },
        }
        for d, w, c in zip(config.grow_dims, wall, cpu, strict=True)
    ]
    data = {"growth_timing": growth_timing(config, growth), "repeats": 2, "world_size": 4}
    first = {"rng_replay": {"first_s": 0.1, "median_s": 0.1, "ratio": 1.0}}
    return LabResult("pp-seed", data | {"cores": 2, "first_call": first})


def test_a_hump_in_wall_time_only_is_called_waiting():
    text = report.growth_timing_sentence(_growth_result([0.5, 0.1, 0.3], [0.01, 0.02, 0.04], 3.0))
    assert "a hump" in text and "(d) rng_replay (width 32 -> 64)" in text
    assert "the hump is waiting (for a core, or for another rank), not work" in text
    assert "up to 3.0x apart in wall time (4 ranks on 2 cores)" in text


def test_a_hump_in_cpu_time_too_is_not_called_waiting():
    text = report.growth_timing_sentence(_growth_result([0.5, 0.1, 0.3], [0.04, 0.01, 0.05]))
    assert "The CPU time dips too, for (d) rng_replay (width 32 -> 64)" in text
    assert "not work" not in text


def test_first_calls_are_called_costly_only_when_they_were():
    ranks = [
        {"first_call_s": {"rng_replay": 0.5, "same_seed": 0.02}},
        {"first_call_s": {"rng_replay": 0.1, "same_seed": 0.021}},
    ]
    rows = {"rng_replay": {"init_time_s": 0.05}, "same_seed": {"init_time_s": 0.02}}

    def sentence() -> str:
        return report.first_call_sentence(
            LabResult("pp-seed", {"first_call": first_calls(ranks, rows)})
        )

    first = first_calls(ranks, rows)
    assert first["rng_replay"] == {"first_s": 0.5, "median_s": 0.05, "ratio": pytest.approx(10.0)}
    text = sentence()
    assert (
        "longer than the measured median for (d) rng_replay — 10.0x: 500.0 ms against 50.0" in text
    )
    assert "same_seed" not in text
    ranks[0]["first_call_s"]["same_seed"] = 0.06  # 3x: now both were slow the first time
    both = sentence()
    assert "for (d) rng_replay and (b) same_seed — up to 10.0x: 500.0 ms" in both
    assert "against 50.0 ms for (d) rng_replay" in both
    for r in ranks:  # first calls as fast as the measured ones
        r["first_call_s"] = {"rng_replay": 0.05, "same_seed": 0.02}
    assert "first calls cost nothing extra here" in sentence()


def test_no_hump_when_the_time_never_falls():
    text = report.growth_timing_sentence(_growth_result([0.1, 0.11, 0.3], [0.01, 0.02, 0.04]))
    assert text.startswith("Measured: no hump") and "waiting" not in text


# -- "same seed on every stage harms convergence" ------------------------------------------------


def _convergence(unsplit: list[float], same: list[float]) -> LabResult:
    """Curves whose last steps sit at the given final losses (one per seed)."""
    config = PPSeedConfig(convergence_seeds=len(unsplit), convergence_steps=20)
    curves = {
        "unsplit": {k: [4.0] * 10 + [u] * 10 for k, u in enumerate(unsplit)},
        "same_seed": {k: [4.0] * 10 + [s] * 10 for k, s in enumerate(same)},
    }
    return LabResult("pp-seed", {"convergence": convergence.compare(config, curves)})


def test_convergence_harm_is_shown_only_when_the_paired_interval_excludes_zero():
    worse = _convergence([2.00, 2.02, 2.01, 2.03, 2.00], [2.10, 2.12, 2.09, 2.12, 2.11])
    assert worse["convergence"]["harm_shown"] is True
    text = report.convergence_sentence(worse)
    assert "ended +0.0960 from the unsplit init on average" in text
    assert "95 % interval of that difference (Student's t, 4 degrees of freedom)" in text
    assert "above 0: here the same seed on every stage did harm convergence" in text
    # Mixed signs: the interval holds 0, whatever the spread of the unsplit init.
    mixed = _convergence([2.00, 2.02, 2.01, 2.0, 2.0], [2.20, 1.90, 2.01, 2.0, 2.05])
    assert mixed["convergence"]["harm_shown"] is False
    text = report.convergence_sentence(mixed)
    assert (
        text.startswith("Measured (5 seeds, 20 steps each): inconclusive") and "includes 0" in text
    )
    # The gap along the run: the curves sit at 4.0 for 10 steps, then at the final values.
    assert "step 5 +0.0000, step 10 +0.0000, step 15 +0.0260, step 20 +0.0260" in text


def test_the_convergence_verdict_needs_five_seeds_and_says_so():
    """Issue 25, item 8: measured on the default pipeline (200 steps), +0.015 at 3 seeds came
    out "shown" under the old rule (against the unsplit init's max - min) and not at 5 seeds;
    3 tight seeds pass a t-interval too. Below 5 seeds the sentence gives the interval and says
    it is too few; at 5 it judges."""
    three = _convergence([2.000, 2.008, 2.004], [2.0096, 2.0271, 2.0177])  # as measured: +0.015
    assert three["convergence"]["interval"][0] > 0 and three["convergence"]["harm_shown"] is False
    text = report.convergence_sentence(three)
    assert "inconclusive" in text and "3 seeds are fewer than the 5 a verdict needs" in text
    five = _convergence(
        [2.000, 2.008, 2.004, 2.025, 1.995], [2.0096, 2.0271, 2.0177, 2.0182, 2.0197]
    )
    assert five["convergence"]["interval"][0] < 0 < five["convergence"]["interval"][1]
    assert "includes 0" in report.convergence_sentence(five)


def test_convergence_the_other_way_and_with_one_seed():
    better = report.convergence_sentence(
        _convergence([2.1, 2.12, 2.11, 2.1, 2.13], [2.0, 2.01, 2.0, 2.02, 2.01])
    )
    assert "below 0: here it did not harm convergence" in better
    one = report.convergence_sentence(_convergence([2.0], [2.5]))
    assert "with one seed there is nothing to judge it by" in one and "did harm" not in one


def test_the_tasks_floor_is_what_an_oracle_scores_on_its_batches():
    vocab, keep = 64, convergence.KEEP
    perm = torch.randperm(
        vocab, generator=torch.Generator().manual_seed(convergence.PERMUTATION_SEED)
    )
    nll = []
    for step in range(20):
        x, y = convergence.task_batch(vocab, 64, 16, step)
        hit = y == perm[x]
        p = torch.where(hit, keep + (1 - keep) / vocab, (1 - keep) / vocab)
        nll.append(-p.log().mean().item())
    assert sum(nll) / len(nll) == pytest.approx(convergence.entropy_floor(vocab), abs=0.03)
    assert convergence.entropy_floor(vocab) < math.log(vocab)
    a, b = convergence.task_batch(vocab, 4, 16, 3), convergence.task_batch(vocab, 4, 16, 3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[0][:, 1:], a[1][:, :-1])


def test_the_same_seed_model_repeats_its_first_layers_and_the_unsplit_one_does_not():
    config = PPSeedConfig(stages=4, layers=4)
    same = convergence.initial_model(config, "same_seed", 0).state_dict()
    unsplit = convergence.initial_model(config, "unsplit", 0).state_dict()
    key = "layers.{}.attn.qkv.weight"
    assert torch.equal(same[key.format(1)], same[key.format(2)])  # stages 1 and 2 alike
    assert not torch.equal(unsplit[key.format(1)], unsplit[key.format(2)])
    assert torch.equal(same["tok_emb.weight"], unsplit["tok_emb.weight"])  # stage 0 is right
    with pytest.raises(ValueError, match="init='other': allowed one of"):
        convergence.initial_model(config, "other", 0)


# -- the sentences about the four strategies, each way -------------------------------------------


def _row(**kw) -> dict:
    row = {
        "bitwise_equal": True,
        "max_abs_diff": 0.0,
        "peak_bytes_per_rank": [50, 50],
        "loss_matches_baseline": True,
        "loss_max_rel_diff": 1e-7,
        "mesh": {"replicas_equal": True, "stages_distinct": True},
    }
    return row | kw


def test_exactness_sentence_follows_the_verdicts():
    rows = {"rng_replay": _row(), "same_seed": _row(bitwise_equal=False, max_abs_diff=0.117)}
    text = report.exactness_sentence(LabResult("pp-seed", {"strategies": rows}))
    assert "(d) rng_replay gives every stage exactly the unsplit init's values" in text
    assert "(b) same_seed does not (largest |difference| 0.117)" in text
    rows["rng_replay"] = _row(bitwise_equal=False, max_abs_diff=0.5)
    text = report.exactness_sentence(LabResult("pp-seed", {"strategies": rows}))
    assert "exactly" not in text
    assert "(d) rng_replay and (b) same_seed do not give the stages the unsplit init's" in text


def test_peaks_sentence_names_who_held_the_whole_model():
    rows = {"seed_checkpoint": _row(peak_bytes_per_rank=[100, 40]), "rng_replay": _row()}
    data = {"strategies": rows, "full_model_bytes": 100}
    text = report.peaks_sentence(LabResult("pp-seed", data))
    assert "under (a) seed_checkpoint rank 0 held the whole model" in text
    assert "under (d) rng_replay no rank's peak reached the whole model (highest 50 B, 50%" in text
    rows["seed_checkpoint"] = _row(peak_bytes_per_rank=[60, 40])
    text = report.peaks_sentence(LabResult("pp-seed", data))
    assert "held" not in text and "(a) seed_checkpoint and (d) rng_replay no rank's" in text


def test_traffic_sentence_sets_replay_bytes_beside_the_theory():
    row = _row(bytes_moved=10112, theory_bytes_moved=10112)
    data = {"strategies": {"rng_replay": row}, "handoffs": 2, "generator_state_bytes": 5056}
    assert "exactly what `theory.rng_replay_bytes` counts" in report.traffic_sentence(
        LabResult("pp-seed", data)
    )
    row["bytes_moved"] = 5056
    assert "not the 10,112 B" in report.traffic_sentence(LabResult("pp-seed", data))


def test_loss_and_mesh_sentences_follow_the_verdicts():
    rows = {
        "rng_replay": _row(),
        "same_seed": _row(loss_matches_baseline=False, loss_max_rel_diff=3e-3),
    }
    rows["same_seed"]["mesh"] = {"replicas_equal": True, "stages_distinct": False}
    data = {"strategies": rows, "stages": 2, "dp": 2}
    text = report.loss_sentence(LabResult("pp-seed", data))
    assert "(d) rng_replay trained like single-process training" in text
    assert "(b) same_seed follows other curves (largest relative difference 3.0e-03)" in text
    mesh = report.mesh_sentence(LabResult("pp-seed", data))
    assert "identical weights under (d) rng_replay and (b) same_seed" in mesh
    assert "the stages repeat each other under (b) same_seed" in mesh
    rows["same_seed"]["mesh"] = {"replicas_equal": False, "stages_distinct": True}
    mesh = report.mesh_sentence(LabResult("pp-seed", data))
    assert "they differ under (b) same_seed" in mesh and "distinct under every strategy" in mesh


def test_overlap_sentence_follows_the_measured_overlap():
    def over(**kw) -> dict:
        base = {
            "first_layer_corr_0_1": -0.004,
            "shared_prefix_values_0_1": 0,
            "duplicate_fraction_per_stage": [None, 5e-4],
            "duplicate_fraction": 5e-4,
            "identical_first_layers": [],
            "stages_distinct": True,
        }
        return base | kw

    bug = over(shared_prefix_values_0_1=26624, duplicate_fraction_per_stage=[None, 1.0, 1.0])
    bug |= {"identical_first_layers": [[1, 2]], "stages_distinct": False}
    rows = {"same_seed": _row(overlap=bug), "rng_replay": _row(overlap=over())}
    text = report.overlap_sentence(LabResult("pp-seed", {"strategies": rows}))
    assert "correlate at -0.004 (no visible relation)" in text and "first 26,624 values" in text
    assert "every value a later stage drew was drawn on an earlier stage" in text
    assert "the first layers of stages 1 and 2 are identical" in text
    assert "(d) rng_replay: no two consecutive values repeat" in text
    rows["same_seed"] = _row(
        overlap=over(first_layer_corr_0_1=0.9, duplicate_fraction_per_stage=[None, 0.5])
    )
    text = report.overlap_sentence(LabResult("pp-seed", {"strategies": rows}))
    assert "(a visible relation)" in text and "50.00%" in text and "identical" not in text


def test_growth_sentence_says_whose_rank_0_followed_the_model():
    def row(dim: int, full: int, ckpt0: int) -> dict:
        return {
            "dim": dim,
            "full_model_bytes": full,
            "seed_checkpoint": {"peak_bytes_per_rank": [ckpt0, full // 2]},
            "rng_replay": {"peak_bytes_per_rank": [full // 2, full // 2]},
        }

    data = {
        "growth": [row(32, 100, 100), row(64, 400, 400)],
        "strategies": {"seed_checkpoint": 0, "rng_replay": 0},
    }
    text = report.growth_sentence(LabResult("pp-seed", data))
    assert "grew 4.0x" in text and "rank 0's peak under (a) seed_checkpoint followed it" in text
    assert "under (d) rng_replay no rank reached the whole model at any width (at most 50%" in text
    data["growth"][1] = row(64, 400, 300)  # rank 0 fell short of the model once
    assert "followed" not in report.growth_sentence(LabResult("pp-seed", data))


# -- docs/labs.md's table, and the figures -------------------------------------------------------


def test_readme_table_does_not_move_with_times_or_peaks():
    row = _row(bytes_moved=5056, messages=2, init_time_s=0.03, checkpoint_file_bytes=1000)
    data = {"strategies": {"rng_replay": row}, "handoffs": 1, "generator_state_bytes": 5056}
    first = report.readme_table(LabResult("pp-seed", data))
    moved = copy.deepcopy(data)
    moved["strategies"]["rng_replay"] |= {"init_time_s": 9.9, "peak_bytes_per_rank": [1, 2]}
    assert report.readme_table(LabResult("pp-seed", moved)) == first
    assert (
        "| (d) rng_replay | yes | 5,056 B in 2 message(s) = 1 handoff(s) x 5,056 B | yes | yes |"
        in first
    )
    moved["strategies"]["rng_replay"]["bitwise_equal"] = False
    assert report.readme_table(LabResult("pp-seed", moved)) != first


def _hidden_lines(fig: Figure) -> list[tuple[str, str]]:
    """Pairs of lines in one panel that lie on each other with nothing to tell them apart."""
    hidden = []
    for ax in fig.axes:
        # The labelled series (an error bar's caps are unlabelled parts of its series).
        lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
        for i, a in enumerate(lines):
            for b in lines[i + 1 :]:
                same_place = list(a.get_xdata()) == list(b.get_xdata()) and all(
                    math.isclose(p, q, rel_tol=0.02)
                    for p, q in zip(a.get_ydata(), b.get_ydata(), strict=True)
                )
                if same_place and a.get_marker() == b.get_marker():
                    hidden.append((a.get_label(), b.get_label()))
    return hidden


def test_no_series_hides_another_in_the_growth_and_scaling_figures():
    strategies = ("seed_checkpoint", "same_seed", "per_stage_seed", "rng_replay")

    def cost(full: int, rank0: int) -> dict:  # every strategy alike but (a): lines on lines
        return {
            "peak_bytes_per_rank": [rank0, full // 4, full // 4, full // 4],
            "init_time_s": 0.1, "init_time_s_runs": [0.1, 0.1, 0.1],
            "init_time_s_per_rank": [0.1] * 4, "cpu_time_s_per_rank": [0.05] * 4,
            "cpu_time_s_runs": [0.05] * 3,
        }  # fmt: skip

    growth = [
        {"dim": d, "full_model_bytes": f}
        | {s: cost(f, f if s == "seed_checkpoint" else f // 4) for s in strategies}
        for d, f in ((64, 2**20), (128, 2**22))
    ]
    result = _scaling_result({s: [0.1] * 4 for s in SCALED})
    data = {
        "growth": growth, "strategies": dict.fromkeys(strategies), "world_size": 4, "repeats": 3,
        "model": {"n_layers": 8}, "scaling": result["scaling"], "cores": 4,
    }  # fmt: skip
    for draw in (growth_figure, growth_time_figure, scaling_figure):
        assert _hidden_lines(draw(LabResult("pp-seed", data))) == [], draw.__name__
