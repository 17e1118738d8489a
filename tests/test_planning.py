"""The planner against measurement: fake ranks at real size, real ranks on a twin, the paper.

The fake rank runs our `shard()` on the real-size model under PyTorch's fake process group and
FakeTensorMode; the planner only computes. Bytes per collective must agree exactly (the same
units, padded the same way); the model state (shards, optimizer state, gathered units)
exactly; the peak's total within 2 % at real size (10 % on a twin of a few MiB) — the planner
picks the largest of the step's moments (`theory.rank_memory`), and gradients and activations
at that moment can be filed differently (a whole gradient born in backward is "activations"
to the tracker) while the total agrees.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fsdp_lab
from fsdp_lab.planning.fake_ranks import Run, on_real_rank, run_in_subprocess
from fsdp_lab.planning.verify import compare, fake_run

TWIN = "llama3-8b-twin"
EXACT = ("parameters", "optimizer_state")
TWIN_TOTAL, REAL_TOTAL = 0.10, 0.02  # the peak's total: twins (seq 64), real sizes


def _bytes_agree_exactly(plan: dict) -> None:
    verified = plan["verified"]
    assert set(verified["comm_bytes_rel_diff"].values()) == {0.0}, verified["comm_bytes_rel_diff"]
    assert verified["comm_bytes_per_rank"]["by_link"] == plan["comm_bytes_per_rank"]["by_link"]


def _verified(*plans: dict) -> list[dict]:
    """Each plan with its fake rank's measurement, the runs in one process (torch once)."""
    measured = run_in_subprocess(*(fake_run(p) for p in plans))
    measured = measured if len(plans) > 1 else [measured]
    return [{**p, "verified": compare(p, m)} for p, m in zip(plans, measured, strict=True)]


def test_a_fake_rank_sends_exactly_the_planned_bytes_and_holds_the_planned_model_state():
    setups = [
        ("zero3", 8, None),
        ("zero2", 8, None),
        ("ddp", 8, None),
        ("hsdp", 16, (2, 8)),
        ("hsdp-zero2", 16, (4, 4)),
    ]
    plans = [fsdp_lab.plan(TWIN, gpus=g, strategy=s, mesh=m, seq=64) for s, g, m in setups]
    recomputed = fsdp_lab.plan(TWIN, gpus=8, seq=64, checkpoint="blocks")
    *plans, recomputed = _verified(*plans, recomputed)
    for plan in [*plans, recomputed]:
        _bytes_agree_exactly(plan)
        diff = plan["verified"]["per_rank_bytes_rel_diff"]
        assert all(diff[k] == 0.0 for k in EXACT), (plan["strategy"], diff)
        assert abs(diff["total"]) < TWIN_TOTAL, (plan["strategy"], diff)
        # The gathered units at the peak are exactly those of one of the plan's moments.
        gathered = plan["verified"]["per_rank_bytes"]["gathered"]
        moments = plan["per_rank_bytes_by_moment"].values()
        assert gathered in {m["gathered"] for m in moments}, (plan["strategy"], gathered)
    hsdp = plans[3]["comm_bytes_per_rank"]["by_link"]  # shard group in a node, replicas across
    assert hsdp["inter_node"] > 0 and hsdp["intra_node"] > 0
    # Recomputing every block keeps fewer activations than keeping them, measured.
    acts = [p["verified"]["per_rank_bytes"]["activations"] for p in (recomputed, plans[0])]
    assert acts[0] < acts[1]


@pytest.mark.e2e  # three 8B fake ranks (90 s here); the twins above test the same path exactly
def test_at_real_size_the_peak_is_within_two_percent_at_the_cheap_corners():
    """Issue 36, point 3: Llama-3-8B on 64 GPUs, ZeRO-3 with every block recomputed, was
    planned at 7.33 GiB and measured at 10.19 (-28 %): the root unit's whole gradient and its
    fp32 copy, reduced last, were missing. The cheap corners of the grid (the whole grid:
    `benchmarks/bench_plan.py --grid`): that case, per-op checkpointing with accumulation
    under HSDP, and DDP at sequence 1, where Adam's temporaries make the peak."""
    plans = _verified(
        fsdp_lab.plan("llama3-8b", gpus=64, checkpoint="blocks"),
        fsdp_lab.plan("llama3-8b", gpus=64, strategy="hsdp", checkpoint="selective-op", seq=1,
                      grad_accumulation=2),
        fsdp_lab.plan("llama3-8b", gpus=64, strategy="ddp", seq=1),
    )  # fmt: skip
    for plan in plans:
        _bytes_agree_exactly(plan)
        diff = plan["verified"]["per_rank_bytes_rel_diff"]
        assert diff["parameters"] == 0.0, diff
        assert abs(diff["total"]) < REAL_TOTAL, (plan["strategy"], plan["peak_moment"], diff)
    assert plans[0]["peak_moment"] == "root_reduce"
    # A simulated 8B rank costs this process's own objects, not the model's 32 GB.
    assert max(p["verified"]["peak_rss_bytes"] for p in plans) < 3 * 2**30


def test_a_fake_rank_measures_exactly_what_a_real_rank_measures_and_fully_shard_alike(cluster_of):
    # The twin trained on two real gloo ranks, and simulated as rank 0 of 2: every category at
    # the peak and every byte sent are the same numbers.
    runs = [
        Run(model=TWIN, world=2, strategy=s, mesh=m, seq=64)
        for s, m in (("full", None), ("none", None), ("hybrid", (1, 2)))
    ]
    ours8, theirs8, *fakes = run_in_subprocess(
        Run(model=TWIN, world=8, seq=64), Run(model=TWIN, world=8, seq=64, system="fsdp2"), *runs
    )
    for run, fake in zip(runs, fakes, strict=True):
        real = cluster_of(2).run(on_real_rank, run)[0]
        assert fake["peak_by_category"] == real["peak_by_category"], run.strategy
        assert fake["comm_bytes_per_step"] == real["comm_bytes_per_step"], run.strategy
    # FSDPMemTracker's categories beside ours, the same fake mode: the same sharded parameters
    # and Adam state (one padded flat shard per unit vs per-parameter shards: equal here, every
    # size divides), the peaks within 5 %.
    peak = theirs8["peak_by_category"]
    assert peak["Sharded Param"] == ours8["peak_by_category"]["parameters"]
    assert peak["OptState"] == ours8["peak_by_category"]["optimizer_state"]
    assert abs(theirs8["peak_bytes"] / ours8["peak_bytes"] - 1) < 0.05


def test_the_planner_reproduces_zero_table_1():
    # Rajbhandari et al. 2020, Table 1: 7.5B parameters, 64 GPUs, K = 12.
    paper = fsdp_lab.plan("7.5e9", gpus=64)["zero_paper_bytes"]
    assert {k: float(f"{v / 1e9:.3g}") for k, v in paper.items()} == {
        "DDP": 120.0,
        "ZeRO-1": 31.4,
        "ZeRO-2": 16.6,
        "ZeRO-3": 1.88,
    }


def test_what_does_not_fit_says_the_cheapest_change_or_why_none_helps():
    big = fsdp_lab.plan("llama3-70b", gpus=64, strategy="zero3", seq=8192)
    assert not big["fits"] and big["to_fit"] == "checkpoint='blocks'"
    assert fsdp_lab.plan("llama3-70b", gpus=64, seq=8192, checkpoint="blocks")["fits"]
    from fsdp_lab.planning.report import verdict

    huge = fsdp_lab.plan("llama3-405b", gpus=512, seq=65536, checkpoint="blocks")
    assert not huge["fits"] and huge["to_fit"] is None
    assert "tensor or context parallelism" in verdict(huge)


def _plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_lab", "plan", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent,  # a factory here (plan_models) is importable, as the CLI says
    )


def test_fsdp_lab_plan_json_has_the_promised_keys():
    # (--verify fake is plan(verify="fake"), measured above; here the command line's own part.)
    proc = _plan_cli(
        "--model", TWIN, "--gpus", "16", "--strategy", "hsdp", "--mesh", "2,8", "--seq", "64",
        "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    for key in ("per_rank_bytes", "comm_bytes_per_rank", "step_time_s", "fits", "assumptions"):
        assert key in plan, key
    assert "total" in plan["per_rank_bytes"] and plan["mesh"] == [2, 8]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--gpus", "12"], "gpus=12 is not a whole number of nodes of 8"),
        (["--strategy", "hsdp", "--gpus", "16", "--mesh", "3,3"], "replicas x shard group must"),
        (["--strategy", "zero3", "--mesh", "2,4"], "is for HSDP only"),
        (["--mesh", "2x4", "--strategy", "hsdp"], "--mesh '2x4': expected R,S"),
        (["--model", "llama3-70"], "did you mean 'llama3-70b'?"),
        (["--model", "1e3"], "a parameter count must be a number from 1e+08 to"),
        (["--model", "no_such_module:factory"], "no_such_module"),
        (["--gpu", "h1000"], "invalid choice: 'h1000'"),
        # issue 36, hostile input: each one line, exit 2, no traceback
        (["--model", "inf"], "a parameter count must be a number from 1e+08 to"),
        (["--model", "1e400"], "a parameter count must be a number from 1e+08 to"),
        (["--model", "nan"], "a parameter count must be a number from 1e+08 to"),
        (["--gpus", str(10**12)], "expected at most 1,048,576"),
        (["--mfu", "0"], "mfu=0.0: expected the share of peak FLOPS"),
        (["--mfu", "nan"], "mfu=nan: expected the share of peak FLOPS"),
        (["--grad-accumulation", "0"], "grad_accumulation=0: expected an int >= 1"),
        (["--model", "plan_models:exits"], "ended the process (exit code 0) without an answer"),
        (["--model", "plan_models:no_vocab", "--verify", "fake"], "says no vocabulary"),
    ],
)
def test_bad_plan_input_gets_one_line_and_a_hint(args, says):
    proc = _plan_cli(*args)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "field, value",
    [("memory_gib", float("nan")), ("memory_gib", float("inf")), ("bf16_tflops", -1.0),
     ("nic_gbit_s", 0), ("efficiency", 0.0), ("efficiency", 1.5)],
)  # fmt: skip
def test_a_gpu_with_impossible_figures_is_refused_naming_the_field(field, value):
    from fsdp_lab.planning.planner import GPU

    figures = {"memory_gib": 80, "bf16_tflops": 989, "intra_gbytes_s": 450, "nic_gbit_s": 400}
    with pytest.raises(ValueError, match=f"{field}="):
        GPU("mine", **{**figures, field: value})


def test_every_preset_and_strategy_is_said_in_words_with_its_peak_moment():
    """Issue 36, point 1: ZeRO-1's plans that peak at the end of backward were an internal
    error (KeyError) in the summary and in notebook 08's widget."""
    from fsdp_lab.planning.planner import STRATEGIES
    from fsdp_lab.planning.report import MOMENTS, summary

    for model in ("llama3-8b", "llama3-70b"):
        for strategy in STRATEGIES:
            for checkpoint in ("none", "blocks"):
                plan = fsdp_lab.plan(model, gpus=64, strategy=strategy, checkpoint=checkpoint,
                                     seq=8192)  # fmt: skip
                assert MOMENTS[plan["peak_moment"]] in summary(plan)
    zero1 = fsdp_lab.plan("llama3-70b", gpus=64, strategy="zero1", checkpoint="blocks", seq=8192)
    # every block's whole gradient is still held when the root's is assembled (issue 36, 3)
    assert zero1["peak_moment"] == "root_backward"


def test_the_zero_paper_line_states_this_plans_own_bytes_at_its_peak():
    """Issue 36, point 6: the line said ZeRO-1/2 hold 2Ψ where the plan's own ZeRO-1 peak
    holds the paper's 4Ψ (the gathered model and every whole gradient, in bf16)."""
    from fsdp_lab.planning.report import zero_paper_line

    zero1 = fsdp_lab.plan("llama3-8b", gpus=64, strategy="zero1", checkpoint="blocks")
    line = zero_paper_line(zero1)
    assert zero1["peak_moment"] == "root_backward"
    # 2: the gathered bf16 model; under 2: every block's whole gradient in bf16 (the root's,
    # 13 % of 8B, is being assembled in autograd's buffer: counted among activations)
    found = re.search(
        r"holds ([\d.]+) bytes per parameter of gathered parameters and ([\d.]+) of", line
    )
    assert found and float(found[1]) == 2 and 1.6 < float(found[2]) < 2, line


def test_the_fix_search_tries_changes_together_and_ranks_them_by_cost():
    """Issue 36, point 2: 70B on 8 GPUs was "no change makes it fit" (one change at a time),
    though recomputing blocks on 32 GPUs fits."""
    from fsdp_lab.planning.report import as_flags

    big = fsdp_lab.plan("llama3-70b", gpus=8, seq=8192)
    assert big["to_fit"] == "checkpoint='blocks', gpus=32"
    assert as_flags(big["to_fit"]) == "--checkpoint blocks --gpus 32"
    fix = big["changes_that_fit"][0]
    again = fsdp_lab.plan("llama3-70b", gpus=32, seq=8192, checkpoint="blocks")
    assert again["fits"] and fix["peak_bytes"] == again["per_rank_bytes"]["total"]
    costs = [f["gpu_s_per_1k_tokens"] for f in big["changes_that_fit"]]
    assert costs == sorted(costs)
    # "the activations of one sequence" are one sequence's, whatever the micro-batch
    two = fsdp_lab.plan("llama3-405b", gpus=8, seq=8192, micro_batch=2)
    one = fsdp_lab.plan("llama3-405b", gpus=8, seq=8192)
    assert two["activations_one_sequence"] == one["per_rank_bytes"]["activations"]


def test_bytes_by_link_are_per_gpu_as_the_ring_routes_them():
    """Issue 36, point 5: ZeRO-3 over 8 nodes said every byte crossed the network per GPU;
    a ring over 64 GPUs leaves each node once, so 1/8 of a GPU's bytes cross."""
    plan = fsdp_lab.plan("llama3-70b", gpus=64, checkpoint="blocks", seq=8192)
    comm = plan["comm_bytes_per_rank"]
    total = sum(comm["by_collective"].values())
    assert comm["by_link"]["inter_node"] == pytest.approx(total / 8)
    assert comm["by_link"]["intra_node"] == pytest.approx(total * 7 / 8)
    hsdp = fsdp_lab.plan("llama3-8b", gpus=64, strategy="hsdp")["comm_bytes_per_rank"]
    assert hsdp["by_link"]["inter_node"] == pytest.approx(
        sum(hsdp["by_group"]["replicate"].values())
    )


def test_the_cheapest_change_is_said_as_the_command_lines_option():
    proc = _plan_cli("--model", "llama3-70b", "--gpus", "64", "--seq", "8192")
    assert proc.returncode == 0, proc.stderr
    assert "`--checkpoint blocks` (in Python: `checkpoint='blocks'`)" in proc.stdout


def test_a_parameter_count_is_planned_as_a_stated_transformer_shape():
    """Issue 36, point 4: a bare count was one unit counted three times as gathered (33x the
    ZeRO paper's ZeRO-3 row) that "peaked in the last block's backward" without blocks."""
    from fsdp_lab.planning.report import summary

    rows = {}
    for strategy in ("zero1", "zero2", "zero3"):
        plan = fsdp_lab.plan("7.5e9", gpus=64, strategy=strategy)
        assert abs(plan["parameters"] / 7.5e9 - 1) < 0.001  # the shape lands on the count
        assert plan["per_rank_bytes"]["activations"] > 0  # counted: it has blocks now
        assert "dim 3968, 31 blocks" in summary(plan)  # and says which shape it planned
        held = plan["per_rank_bytes_by_moment"]
        rows[strategy] = (plan, held)
    paper = rows["zero3"][0]["zero_paper_bytes"]  # Table 1, for the 7.5B typed
    state = ("parameters", "gradients", "optimizer_state")
    # ZeRO-3: the shards at the end of forward are the paper's 16 bytes per parameter / N
    zero3 = sum(rows["zero3"][1]["end_of_forward"][k] for k in state)
    assert zero3 / paper["ZeRO-3"] == pytest.approx(1, abs=0.002)
    # ZeRO-2: and the gathered bf16 model; ZeRO-1: and every whole bf16 gradient (its peak)
    zero2 = sum(rows["zero2"][1]["end_of_forward"][k] for k in (*state, "gathered"))
    zero1 = sum(rows["zero1"][0]["per_rank_bytes"][k] for k in (*state, "gathered"))
    assert 0.9 < zero2 / paper["ZeRO-2"] < 1.1 and 0.9 < zero1 / paper["ZeRO-1"] < 1.1
    # 8e9 lands on Llama-3-8B's own shape: the same plan
    assert (
        fsdp_lab.plan("8e9", gpus=64)["per_rank_bytes"]
        == (fsdp_lab.plan("llama3-8b", gpus=64)["per_rank_bytes"])
    )


def test_a_factory_that_hangs_is_stopped_at_the_stated_limit_and_said(monkeypatch):
    from fsdp_lab.planning import models

    monkeypatch.setattr(models, "BUILD_TIME_LIMIT_S", 3)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    with pytest.raises(ValueError, match="'plan_models:hangs': building it on the meta device "
                       "did not finish in 3 s"):  # fmt: skip
        fsdp_lab.plan("plan_models:hangs")


def test_accumulation_utilisation_and_presets_change_what_they_should():
    one = fsdp_lab.plan("llama3-8b", gpus=64, checkpoint="selective")
    four = fsdp_lab.plan("llama3-8b", gpus=64, checkpoint="selective", grad_accumulation=4)
    # every micro-batch gathers and reduces again; four forwards and backwards per step
    for op, sent in one["comm_bytes_per_rank"]["by_collective"].items():
        assert four["comm_bytes_per_rank"]["by_collective"][op] == 4 * sent
    assert four["step_time_parts"]["compute_s"] == pytest.approx(
        4 * one["step_time_parts"]["compute_s"]
    )
    # the gradient shards of the micro-batch before are held where one step holds none
    assert four["per_rank_bytes_by_moment"]["loss_backward"]["gradients"] > 0
    assert one["per_rank_bytes_by_moment"]["loss_backward"]["gradients"] == 0
    slow = fsdp_lab.plan("llama3-8b", gpus=64, checkpoint="selective", mfu=0.225)
    assert slow["step_time_parts"]["compute_s"] == pytest.approx(
        2 * one["step_time_parts"]["compute_s"]
    )
    # recomputing more costs more time: none < selective-op < selective < blocks
    plans = [fsdp_lab.plan("llama3-8b", gpus=64, seq=8192, checkpoint=c)
             for c in ("none", "selective-op", "selective", "blocks")]  # fmt: skip
    times = [p["step_time_parts"]["compute_s"] for p in plans]
    acts = [p["per_rank_bytes_by_moment"]["end_of_forward"]["activations"] for p in plans]
    assert times == sorted(times)
    # but per-op keeps less than every other block: a block's set is 11·D + 4·F + KV wide,
    # the per-op policy keeps 4·D + F + KV of each block, every-other-block half of them whole
    none, per_op, every_other, blocks = acts
    assert none > every_other > per_op > blocks
    for name in ("h100", "h100-94gb", "h100-96gb", "h200", "b200", "mi300x", "a100-80gb",
                 "a100-40gb", "l4"):  # fmt: skip
        assert fsdp_lab.plan("llama3-8b", gpus=8, gpu=name)["gpu"] == name
