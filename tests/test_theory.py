"""fsdp_lab.theory: the formulas, checked against published tables and hand-worked cases."""

import pytest

from fsdp_lab import theory
from fsdp_lab.theory import FP32_ADAM, MIXED_ADAM, Precision


def test_precision_gives_the_bytes_per_parameter_of_the_zero_paper():
    assert (FP32_ADAM.p, FP32_ADAM.g, FP32_ADAM.k) == (4, 4, 8)
    assert (MIXED_ADAM.p, MIXED_ADAM.g, MIXED_ADAM.k) == (2, 2, 12)  # fp32 master + m + v
    assert Precision(optimizer="sgd").k == 4
    assert Precision("bfloat16", "float32", "adam", "bfloat16").k == 4
    with pytest.raises(ValueError, match="param_dtype='fp8'"):
        Precision(param_dtype="fp8")


def test_zero_paper_table_1_reproduced():
    # Rajbhandari et al. 2020, Table 1 / Figure 1: Ψ = 7.5B, N = 64, K = 12.
    gb = {k: v / 1e9 for k, v in theory.zero_table(7.5e9, 64, MIXED_ADAM).items()}
    assert gb["none"] == pytest.approx(120.0)
    assert round(gb["optimizer"], 1) == 31.4
    assert round(gb["grad_op"], 1) == 16.6
    assert round(gb["full"], 2) == 1.88
    # The same function with fp32 Adam: what the labs measure (and what the old formula gave).
    fp32 = {k: v / 1e9 for k, v in theory.zero_table(7.5e9, 64, FP32_ADAM).items()}
    assert (fp32["none"], round(fp32["optimizer"], 1), round(fp32["grad_op"], 1)) == (
        120.0,
        60.9,
        31.4,
    )


def test_model_state_by_hand():
    psi, n = 1000, 4
    assert theory.zero_table(psi, n) == {
        "none": 16000.0,
        "optimizer": 8000.0 + 2000.0,
        "grad_op": 4000.0 + 3000.0,
        "full": 4000.0,
        "parameters_replicated": 4000.0,
        "parameters_sharded": 1000.0,
    }
    one = theory.zero_table(psi, 1)  # one rank: every strategy is DDP
    assert one["none"] == one["optimizer"] == one["grad_op"] == one["full"] == 16 * psi
    with pytest.raises(ValueError, match="world_size"):
        theory.model_state_bytes(psi, 0, "full")
    with pytest.raises(ValueError, match="num_params"):
        theory.model_state_bytes(True, 2, "full")
    with pytest.raises(ValueError, match="strategy='zero3'"):
        theory.model_state_bytes(psi, 2, "zero3")


def test_collective_bytes_are_the_ring_formulas():
    assert theory.collective_bytes("all_gather_into_tensor", 100, 4) == 300.0
    assert theory.collective_bytes("reduce_scatter_tensor", 100, 4) == 300.0
    assert theory.collective_bytes("all_reduce", 100, 4) == 150.0
    assert theory.collective_bytes("broadcast", 100, 4) == 100.0
    assert theory.collective_bytes("broadcast", 100, 1) == 0.0
    with pytest.raises(ValueError, match="op='gather'"):
        theory.collective_bytes("gather", 100, 4)


def test_sharding_step_counts_padding_and_the_backward_gather():
    units = [
        {"numel": 10, "padded_numel": 12, "element_size": 4},
        {"numel": 6, "padded_numel": 6, "element_size": 4},
    ]
    full = theory.sharding_step("full", units, 3)
    assert full["comm_bytes"] == {
        "all_gather_into_tensor": 2 * 2 / 3 * 18 * 4,
        "reduce_scatter_tensor": 2 / 3 * 18 * 4,
    }
    assert full["comm_bytes_unpadded"]["reduce_scatter_tensor"] == 2 / 3 * 16 * 4
    assert full["peak_model_state_bytes"] == 16 * 16 / 3 + 12 * 4  # plus the largest unit
    grad_op = theory.sharding_step("grad_op", units, 3)
    assert grad_op["comm_bytes"]["all_gather_into_tensor"] == 2 / 3 * 18 * 4  # gathered once
    sgd = theory.sharding_step("none", units, 3, theory.FP32_SGD)
    assert sgd["peak_model_state_bytes"] == 12 * 16
    assert sgd["comm_bytes"] == {"all_reduce": 2 * 2 / 3 * 16 * 4}


def test_checkpoint_cost_closed_forms():
    from fsdp_lab.checkpointing import schedules

    n = 16
    assert theory.checkpoint_cost(schedules.Schedule("store_all"), n).forward_calls == n
    assert theory.checkpoint_cost(schedules.Schedule("full_recompute"), n).forward_calls == 136
    seg = theory.checkpoint_cost(schedules.segments(4), n)
    assert (seg.stored_activations, seg.forward_calls) == (4 + 4 - 1, 16 + 3 * 4)
    with pytest.raises(ValueError):
        theory.checkpoint_cost(schedules.every(17), n)


def test_binomial_law_by_hand_and_against_revolves_recursion():
    from math import comb

    from fsdp_lab.checkpointing import schedules

    # One snapshot: rebuild every state from the input, l(l-1)/2 advances, r = l - 1.
    assert [theory.revolve_advances(steps, 1) for steps in (1, 2, 3, 4)] == [0, 1, 3, 6]
    assert [theory.revolve_repetitions(steps, 1) for steps in (1, 2, 3, 4)] == [0, 1, 2, 3]
    # Two snapshots, four steps: advance 2, keep x2, advance 1; then from x0 advance 1: 4.
    assert (theory.revolve_advances(4, 2), theory.revolve_repetitions(4, 2)) == (4, 2)
    assert theory.binomial_reach(3, 2) == comb(5, 3) == 10
    for s in range(1, 5):
        for steps in range(1, 30):
            r = theory.revolve_repetitions(steps, s)
            assert comb(s + r - 1, s) < steps <= comb(s + r, s) or steps == 1
            # The closed form and Griewank–Walther's recursion (checkpointing/schedules.py) agree.
            advances, repetitions, stored = schedules.revolve_cost(steps, s)
            assert (advances, repetitions) == (theory.revolve_advances(steps, s), r), (steps, s)
            cost = theory.checkpoint_cost(schedules.revolve(s), steps) if s <= steps else None
            if cost is not None:
                assert cost == schedules.ScheduleCost(stored, steps + advances)
    with pytest.raises(ValueError, match="snapshots=0"):
        theory.binomial_reach(0, 3)
    with pytest.raises(ValueError, match="steps=0"):
        theory.revolve_advances(0, 2)


def test_rng_replay_sends_one_generator_state_per_handoff_per_pipeline():
    # S = 3 stages in init order: tok_emb ... (stage 0) -> layers (stage 1) -> ... head (stage 2):
    # 2 handoffs; a CPU generator state is 5056 bytes; 2 pipelines replay side by side.
    assert theory.rng_replay_bytes(2, 5056, 2) == 2 * 2 * 5056 == 20224
    assert theory.rng_replay_bytes(0, 5056, 4) == 0  # one stage: nothing changes hands


def test_sync_module_states_moves_parameters_and_buffers_once_and_nothing_alone():
    assert theory.sync_module_states_bytes(1000, 24, 4) == 1024
    assert theory.sync_module_states_bytes(1000, 24, 2) == 1024  # the same on any N > 1
    assert theory.sync_module_states_bytes(1000, 24, 1) == 0  # one rank: no message


def test_materialise_peak_bytes_by_way_of_building():
    peak = theory.materialise_peak_bytes(800, 120, 4)
    assert peak == {"ordinary": 1000, "meta_param_init_fn": 320, "meta_shard_init": 200}
    one = theory.materialise_peak_bytes(800, 120, 1)  # one rank keeps the whole model anyway
    assert one["meta_shard_init"] == 800 and one["ordinary"] == 1600


def test_the_parallelism_formulas_by_hand():
    # 2 layers, 8 tokens of width 4, fp32, 2 ranks: one all-reduce of 128 B moves 128 B per rank.
    assert theory.tensor_parallel_step_bytes(2, 8, 4, 2) == 2 * 4 * 2 * 128
    # K and V: 2 * (1/2) * 128 = 128 B per rank and layer forward, x3 with backward; plus the
    # gradient all-reduce of 10 parameters (40 B -> 40 B per rank).
    assert theory.context_parallel_step_bytes(2, 8, 4, 10, 2) == 2 * (3 * 2 * 128 + 40)
    # 3 boundaries, each carrying 8 x 4 x 4 B forward and back.
    assert theory.pipeline_step_bytes(4, 8, 4) == 2 * 3 * 128
