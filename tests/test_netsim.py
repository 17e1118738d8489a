"""fsdp_lab.netsim: the alpha-beta model of FSDP and HSDP steps — bytes from the theory the
HSDP lab measures (tests/test_hybrid.py), link by link; times and throughput from them."""

from __future__ import annotations

import pytest

from fsdp_lab import netsim

PSI, B = 7e9, 2
W = netsim.Workload(parameters=PSI, bytes_per_parameter=B)
NET = netsim.Network()


def test_one_node_fsdp_and_hsdp_are_the_same_step_on_nvlink():
    f, h = (netsim.predict(s, 8, W, NET) for s in ("fsdp", "hsdp"))
    assert f["mesh"] == h["mesh"] == [1, 8]
    assert f["bytes_per_rank"] == h["bytes_per_rank"]
    assert f["node_nic_bytes"] == h["node_nic_bytes"] == 0.0
    assert f["comm_s"] == pytest.approx(h["comm_s"])


@pytest.mark.parametrize("nodes", [2, 4, 16, 256])
def test_what_crosses_a_node_nic_per_step(nodes):
    n = 8 * nodes
    f, h = netsim.predict("fsdp", n, W, NET), netsim.predict("hsdp", n, W, NET)
    # FSDP: one ring over the world leaves each node once: 2 all-gathers + 1 reduce-scatter.
    assert f["node_nic_bytes"] == pytest.approx(3 * (n - 1) / n * PSI * B)
    # HSDP: 8 rings (one per shard index) of the gradient shard's all-reduce across R nodes.
    r = nodes
    assert h["node_nic_bytes"] == pytest.approx(2 * (r - 1) / r * PSI * B)
    assert h["bytes_per_rank"]["replicate"]["all_reduce"] == pytest.approx(
        2 * (r - 1) / r * PSI * B / 8
    )
    # The volume per rank barely differs ((S-1)/S vs (N-1)/N): which link carries it does.
    per_rank_f = sum(f["bytes_per_rank"]["shard"].values())
    per_rank_h = (
        sum(h["bytes_per_rank"]["shard"].values()) + h["bytes_per_rank"]["replicate"]["all_reduce"]
    )
    assert per_rank_h == pytest.approx(per_rank_f, rel=0.35)


def test_hsdp_inter_node_traffic_grows_with_nodes_and_fsdp_is_flat_after_two():
    rows = netsim.scaling(W, NET, [2, 4, 8, 16, 32])
    hsdp = [r["node_nic_bytes"] for r in rows["hsdp"]]
    fsdp = [r["node_nic_bytes"] for r in rows["fsdp"]]
    assert hsdp == sorted(hsdp) and hsdp[-1] > 1.8 * hsdp[0]
    assert max(fsdp) < 1.07 * min(fsdp)  # 3(N-1)/N·Ψb: from 2.81 to 2.99 Ψb


def test_step_time_overlap_and_throughput():
    one = netsim.predict("fsdp", 16, netsim.Workload(overlap=0.0), NET)
    assert one["step_s"] == pytest.approx(one["compute_s"] + one["comm_s"])
    hidden = netsim.predict("hsdp", 8, W, NET)  # one node: NVLink hides behind compute
    assert hidden["step_s"] == hidden["compute_s"]
    assert hidden["tflops_per_gpu"] == pytest.approx(W.tflops)
    slow = netsim.predict("fsdp", 16, W, netsim.with_bandwidth(NET, 10))
    fast = netsim.predict("fsdp", 16, W, netsim.with_bandwidth(NET, 400))
    assert slow["tflops_per_gpu"] < fast["tflops_per_gpu"] <= W.tflops


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: netsim.predict("zero", 8, W, NET), "expected 'fsdp' or 'hsdp'"),
        (lambda: netsim.predict("fsdp", 12, W, NET), "multiple of gpus_per_node=8"),
        (lambda: netsim.predict("hsdp", 16, W, NET, shard=3), "divisor of gpus_per_node=8"),
        (lambda: netsim.Workload(overlap=1.5), "overlap=1.5"),
        (lambda: netsim.Network(gpus_per_node=0), "gpus_per_node=0"),
        (lambda: netsim.Workload(units=0), "units=0"),
    ],
)
def test_bad_input_names_the_value(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        call()


def test_the_scaling_table_states_the_models_assumptions_from_its_inputs():
    from fsdp_lab.hsdp.lab.analysis import network_model
    from fsdp_lab.hsdp.lab.report import assumptions

    text = assumptions(network_model(7.0, 100.0))
    assert text.startswith("Assumed, not measured: 7B parameters")
    assert "1 × 100 Gbit/s NIC per node" in text and "450 GB/s" in text
    other = assumptions(network_model(70.0, 400.0, gpus_per_node=4, intra_gb_s=900.0))
    assert "70B parameters" in other and "400 Gbit/s" in other and "4 GPUs per node" in other
    assert "900 GB/s" in other and "shard group S = 4" in other
