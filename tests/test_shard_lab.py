"""Lab 01 end to end: ours, FSDP2 and a single process agree; measured bytes equal theory."""

from __future__ import annotations

import pytest

from fsdp_lab.labs import shard as shard_lab

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
def test_shard_lab_reports_agreement_and_exact_bytes(cluster_of, strategy):
    config = shard_lab.ShardConfig(
        world_size=3, strategy=strategy, steps=3, optimizer="sgd", lr=0.1
    )
    result = shard_lab.run(config, cluster=cluster_of(3))
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


def test_sharded_optimizer_is_measured_beside_zero1(cluster_of):
    """DDP + ShardedOptimizer next to shard(strategy="optimizer"): same training, state per
    rank as assigned, DDP's all-reduce plus a broadcast of every parameter."""
    config = shard_lab.ShardConfig(
        world_size=3, strategy="optimizer", steps=2, optimizer="sgd", lr=0.1
    )
    data = shard_lab.run(config, cluster=cluster_of(3)).to_dict()
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
        shard_lab.summary(shard_lab.LabResult("shard", data))
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"strategy": "zero5"}, "strategy='zero5'"),
        ({"optimizer": "lion"}, "optimizer='lion'"),
        ({"steps": 0}, "steps=0"),
        ({"model": "nocolon"}, "module:factory"),
    ],
)
def test_bad_config_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        shard_lab.ShardConfig(**kwargs)


def test_model_factory_errors_name_the_spec():
    with pytest.raises(ValueError, match="cannot load 'nope'"):
        shard_lab.load_factory("fsdp_lab.models:nope")
