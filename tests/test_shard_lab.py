"""Lab 01 end to end: ours, FSDP2 and a single process agree; measured bytes equal theory."""

from __future__ import annotations

import argparse

import pytest

from fsdp_lab.labs import LabResult
from fsdp_lab.labs.options import add_config_arguments, config_overrides, to_flags
from fsdp_lab.model_spec import load_factory
from fsdp_lab.sharding import lab as shard_lab

KEYS = {
    "world_size",
    "strategy",
    "max_abs_diff_vs_single_process",
    "max_abs_diff_vs_fsdp2",
    "peak_bytes_per_rank",
    "theory_peak_bytes",
    "comm_bytes_per_rank",
    "theory_comm_bytes",
    "step_time_s",
    "fsdp2_step_time_s",
}


@pytest.mark.parametrize("strategy", ["full", "none"])
def test_shard_lab_reports_agreement_and_exact_bytes(cluster_of, one_thread_per_rank, strategy):
    config = shard_lab.ShardConfig(
        world_size=3, strategy=strategy, steps=3, optimizer="sgd", lr=0.1
    )
    with one_thread_per_rank(cluster_of(3)) as cluster:
        result = shard_lab.run(config, cluster=cluster)
    data = result.to_dict()
    assert set(data) >= KEYS
    assert data["world_size"] == 3 and data["strategy"] == strategy
    assert data["max_abs_diff_vs_single_process"] < 1e-5
    assert data["max_abs_diff_vs_fsdp2"] < 1e-5
    assert data["comm_matches_theory"] is True
    assert len(data["peak_bytes_per_rank"]) == 3 and min(data["peak_bytes_per_rank"]) > 0
    assert data["step_time_s"] > 0 and data["fsdp2_step_time_s"] > 0
    th = data["theory"]
    if strategy == "full":  # N=3 pads the units: the exact formula uses the padded Ψ
        assert th["psi_padded"] > th["psi"]
        assert data["theory_comm_bytes"]["reduce_scatter_tensor"] == 2 / 3 * th["psi_padded"] * 4
    else:
        assert data["theory_comm_bytes"] == {"all_reduce": 2 * 2 / 3 * th["psi"] * 4}
    # SGD with momentum: 4 B parameter + 4 B gradient + 4 B momentum per parameter for DDP;
    # ZeRO-3 holds a third of that plus the gathered units.
    peak = max(data["peak_model_state_bytes_per_rank"])
    if strategy == "none":
        assert peak >= 12 * th["psi"]
    else:
        assert peak < 12 * th["psi"] * 0.75
    assert set(shard_lab.figures(result)) == {"memory_trace", "bytes_vs_theory", "timeline"}
    assert "measured equals theory on every rank: True" in shard_lab.summary(result)
    assert data["sharded_optimizer"] is None  # measured beside strategy="optimizer" only


def test_sharded_optimizer_is_measured_beside_zero1(cluster_of, one_thread_per_rank):
    """DDP + ShardedOptimizer next to shard(strategy="optimizer"): same training, state per
    rank as assigned, DDP's all-reduce plus a broadcast of every parameter."""
    config = shard_lab.ShardConfig(
        world_size=3, strategy="optimizer", steps=2, optimizer="sgd", lr=0.1
    )
    with one_thread_per_rank(cluster_of(3)) as cluster:
        data = shard_lab.run(config, cluster=cluster).to_dict()
    so, psi = data["sharded_optimizer"], data["theory"]["psi"]
    assert so["max_abs_diff_vs_single_process"] < 1e-5
    assert so["max_abs_diff_vs_zero1_transformation"] < 1e-5
    assert so["max_abs_diff_vs_zero_redundancy_optimizer"] < 1e-5
    # Every parameter owned by one rank: the shares add up to Ψ, none is smaller than 0.
    assert sum(so["owned_numel_per_rank"]) == psi and min(so["owned_numel_per_rank"]) > 0
    # SGD's momentum: 4 B per element owned, nothing else (Adam would add a step counter).
    th = so["theory"]
    assert so["optimizer_state_bytes_per_rank"] == th["optimizer_state_bytes_per_rank"]
    assert th["optimizer_state_bytes_per_rank"] == [4 * x for x in so["owned_numel_per_rank"]]
    assert th["largest_share_over_even_split"] >= 1
    # ZeRO-1 as a transformation: momentum for the rank's slice of every unit, 4·Ψ_padded/N,
    # less the padding (per-parameter views: the optimizer sees real elements only).
    real = [
        sum(min(max(u["numel"] - r * u["shard_numel"], 0), u["shard_numel"]) for u in data["units"])
        for r in range(3)
    ]
    assert sum(real) == psi and max(real) <= data["theory"]["psi_padded"] / 3
    assert data["optimizer_state_bytes_per_rank"] == [4 * x for x in real]
    # Bytes: DDP's all-reduce 2(N-1)/N·Ψ·4 plus a broadcast of every parameter, Ψ·4.
    assert so["comm_matches_theory"] is True
    for measured in so["comm_bytes_per_rank"]:
        assert measured == {
            "all_reduce": pytest.approx(2 * 2 / 3 * psi * 4, rel=1e-12),
            "broadcast": pytest.approx(psi * 4, rel=1e-12),
        }
    assert "DDP + ShardedOptimizer bytes equal their formula on every rank: True" in (
        shard_lab.summary(LabResult("shard", data))
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"strategy": "zero5"}, "strategy='zero5': expected one of"),
        (
            {"optimizer": "lion"},
            "optimizer='lion': expected one of ['adam', 'sgd']. Fix: optimizer='adam'",
        ),
        (
            {"steps": 0},
            "steps=0 is out of range: allowed an int from 1 to 100,000 (training steps). Fix: steps=5",
        ),
        ({"global_batch": 0}, "global_batch=0 is out of range: allowed an int from 1 to 4,096"),
        ({"model": "nocolon"}, "model='nocolon': expected 'module:factory'"),
        (
            {"world_size": 5},
            "global_batch=12 does not divide over world_size=5 ranks: allowed world sizes "
            "[1, 2, 3, 4, 6, 12]. Fix: world_size=4",
        ),
    ],
)
def test_bad_config_is_a_clear_error_in_python_terms(kwargs, message):
    with pytest.raises(ValueError) as info:
        shard_lab.ShardConfig(**kwargs)
    assert message in str(info.value)


def test_the_command_line_keeps_every_option_and_speaks_errors_in_flags():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, shard_lab.ShardConfig)
    flags = {flag for action in parser._actions for flag in action.option_strings}
    # Every option the lab had before its config generated them, spelled the same.
    assert {
        "--strategy",
        "--steps",
        "--no-prefetch",
        "--optimizer",
        "--no-sharded-optimizer",
    } <= flags
    args = parser.parse_args(
        ["--strategy", "grad_op", "--steps", "2", "--no-prefetch", "--no-fsdp2", "--lr", "0.5"]
    )
    assert config_overrides(args, shard_lab.ShardConfig) == {
        "strategy": "grad_op",
        "steps": 2,
        "prefetch": False,
        "lr": 0.5,
        "compare_fsdp2": False,
    }
    with pytest.raises(ValueError) as info:
        shard_lab.ShardConfig(world_size=5)
    assert to_flags(str(info.value), shard_lab.ShardConfig) == (
        "--global-batch 12 does not divide over --world-size 5 ranks: allowed world sizes "
        "[1, 2, 3, 4, 6, 12]. Fix: --world-size 4"
    )


def test_model_factory_errors_name_the_spec():
    with pytest.raises(ValueError, match="cannot load 'nope'"):
        load_factory("fsdp_lab.models:nope")


def test_the_contract_section_measures_what_its_sentences_say(cluster_of):
    """Notebook 01, section 8: each claim its text makes, on the runs it prints."""
    import torch

    from fsdp_lab.sharding.lab import contract

    cluster = cluster_of(2)
    pair = ("ours:full", "fully_shard")
    precision = {s: cluster.run(contract.precision_run, s) for s in pair}
    ours, theirs = precision["ours:full"][0], precision["fully_shard"][0]
    assert ours["computed_in"]["RMSNorm"] == "input float32 · weight float32"  # a unit, fp32
    assert ours["computed_in"]["Linear"] == "input bfloat16 · weight bfloat16"
    assert theirs["computed_in"]["FSDPLinear"] == ours["computed_in"]["Linear"]
    assert theirs["computed_in"]["FSDPRMSNorm"] == ours["computed_in"]["RMSNorm"]
    assert ours["grad_norms"] == pytest.approx(theirs["grad_norms"], rel=1e-6)
    sent = ours["bytes_per_step"]  # bf16 twice = fp32 once; the root only in the all-reduce
    assert sent["all_gather_into_tensor"] == sent["reduce_scatter_tensor"] > 0
    assert sent["all_reduce"] == ours["norm_numel"] * 4 + 4  # 2(N-1)/N = 1 at N = 2
    assert all(g > contract.MAX_NORM for g in ours["grad_norms"])  # clipping scaled them
    offload = {s: cluster.run(contract.offload_run, s) for s in pair}
    assert "| host → device |" in contract.offload_summary(offload)
    kept = offload["ours:full"][0]
    shards = kept["shard_bytes"]
    again = sum(shards[u] for u in kept["freed_after_forward"])
    assert kept["bytes_per_step"]["host_to_device"] == sum(shards.values()) + again
    assert kept["bytes_per_step"]["device_to_host"] == sum(shards.values())
    buckets = {s: cluster.run(contract.bucket_run, s, 0.05) for s in ("ours:none", "ddp")}
    sent_per_system = []
    for per_rank in buckets.values():
        spans = contract.last_backward(per_rank[0]["timeline"])["spans"]
        starts = [s["start"] for s in spans if s["kind"] == "comm"]
        assert len(starts) > 2 and min(starts) < max(starts)  # sent one by one, during backward
        sent_per_system.append(len(starts))
    assert sent_per_system[0] == sent_per_system[1]  # DDP's bucket rule: as many messages
    ignored = {s: cluster.run(contract.ignored_run, s) for s in pair}
    for rank0, rank1 in ignored.values():
        assert any(
            not torch.equal(rank0["ignored"][n], rank1["ignored"][n]) for n in rank0["ignored"]
        )
    for text in (contract.precision_summary(precision), contract.bucket_summary(buckets)):
        assert "max |ours" in text
