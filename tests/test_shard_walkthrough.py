"""The step-by-step walkthrough shows what the mechanism really holds after every stage."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from fsdp_lab.sharding.lab import report, walkthrough
from fsdp_lab.sharding.lab.figures import stage_figure


@pytest.fixture(scope="module", params=[(2, (3, 2, 2)), (3, (3, 2, 2)), (3, (4, 1))])
def walk(request, cluster_of):
    n, sizes = request.param
    return walkthrough.run(cluster_of(n), numel_per_param=sizes, lr=0.2)


def _rows(walk, stage):
    return [torch.tensor(row) for row in walk["stages"][stage]["rows"]]


def test_stages_in_the_order_they_happen(walk):
    assert list(walk["stages"]) == [
        "flatten",
        "shard",
        "gather",
        "compute",
        "free",
        "reduce-scatter",
        "optimizer step",
    ]
    for stage in walk["stages"].values():
        assert len(stage["rows"]) == walk["world_size"]
        assert stage["explanation"]


def test_flatten_concatenates_the_parameters_and_pads_to_a_multiple_of_n(walk):
    n, layout = walk["world_size"], walk["layout"]
    assert layout["padded_numel"] % n == 0
    assert 0 <= layout["padding"] < n
    assert layout["numel"] + layout["padding"] == layout["padded_numel"]
    for params, flat in zip(walk["parameters"], _rows(walk, "flatten"), strict=True):
        expected = torch.tensor([v for p in params for v in p] + [0.0] * layout["padding"])
        assert torch.equal(flat, expected)
    # Values say where they came from: parameter i holds 10*i + 1, 10*i + 2, ...
    assert walk["parameters"][0][1][0] == 11.0


def test_the_shards_concatenated_are_the_flat_buffer(walk):
    shards = _rows(walk, "shard")
    assert {len(s) for s in shards} == {walk["layout"]["shard_numel"]}
    assert torch.equal(torch.cat(shards), _rows(walk, "flatten")[0])
    assert walk["stages"]["shard"]["unsharded_storage_bytes"] == [0] * walk["world_size"]


def test_gather_gives_every_rank_the_full_flat_buffer(walk):
    flat = _rows(walk, "flatten")[0]
    for gathered in _rows(walk, "gather"):
        assert torch.equal(gathered, flat)
    layout, n = walk["layout"], walk["world_size"]
    full_bytes = layout["padded_numel"] * layout["element_size"]
    assert walk["stages"]["gather"]["unsharded_storage_bytes"] == [full_bytes] * n
    # Ring all-gather: each rank receives the N-1 shards it does not have.
    assert walk["stages"]["gather"]["comm_bytes"] == [(n - 1) / n * full_bytes] * n


def test_compute_gives_each_rank_the_gradient_of_its_own_data(walk):
    flat = _rows(walk, "flatten")[0]
    grads = _rows(walk, "compute")
    for r, (grad, batch) in enumerate(zip(grads, walk["batches"], strict=True)):
        assert batch == [r + 1.0]
        assert torch.allclose(grad, batch[0] * flat)  # d/dp of x * 0.5 |p|^2
    assert not torch.equal(grads[0], grads[1])


def test_free_leaves_zero_bytes_of_unsharded_storage_and_keeps_the_shard(walk):
    assert walk["stages"]["free"]["unsharded_storage_bytes"] == [0] * walk["world_size"]
    for kept, shard in zip(_rows(walk, "free"), _rows(walk, "shard"), strict=True):
        assert torch.equal(kept, shard)


def test_reduce_scatter_keeps_this_ranks_slice_of_the_mean_gradient(walk):
    n, s = walk["world_size"], walk["layout"]["shard_numel"]
    mean_grad = torch.stack(_rows(walk, "compute")).mean(dim=0)
    for r, shard_grad in enumerate(_rows(walk, "reduce-scatter")):
        assert torch.allclose(shard_grad, mean_grad[r * s : (r + 1) * s])
    # = the single-process gradient on the whole batch [1..N]: mean(batch) * p
    flat = _rows(walk, "flatten")[0]
    assert torch.allclose(torch.cat(_rows(walk, "reduce-scatter")), (n + 1) / 2 * flat)
    assert walk["stages"]["reduce-scatter"]["unsharded_storage_bytes"] == [0] * n
    full_bytes = walk["layout"]["padded_numel"] * walk["layout"]["element_size"]
    assert walk["stages"]["reduce-scatter"]["comm_bytes"] == [(n - 1) / n * full_bytes] * n


def test_optimizer_step_updates_only_the_shard(walk):
    lr = walk["lr"]
    shards, grads = _rows(walk, "shard"), _rows(walk, "reduce-scatter")
    for new, old, grad in zip(_rows(walk, "optimizer step"), shards, grads, strict=True):
        assert torch.allclose(new, old - lr * grad)
        assert len(new) == walk["layout"]["shard_numel"]


def test_figures_and_table_show_the_measurement(walk):
    flatten = stage_figure(walk, "flatten")
    assert len(flatten.axes) == 2  # the separate parameters, then the flat buffer
    free = stage_figure(walk, "free")
    zeros = ", ".join(["0"] * walk["world_size"])
    assert f"after free (unsharded storage: {zeros} B)" == free.axes[1].get_title()
    table = report.stage_table(walk).splitlines()
    assert len(table) == 2 + len(walk["stages"])
    assert table[2].startswith("| flatten |") and "| free | " in table[6]


def test_one_rank_has_nothing_to_shard():
    with pytest.raises(ValueError, match="2 or more ranks"):
        walkthrough.run(types.SimpleNamespace(world_size=1))
    with pytest.raises(ValueError, match="numel_per_param"):
        walkthrough.run(types.SimpleNamespace(world_size=2), numel_per_param=(3, 0))


def test_the_owner_broadcasts_claim_is_refuted_point_by_point_from_the_measurement(walk):
    """The course-note picture (one owner broadcasts, receives every gradient) is checked
    against what the ranks measured, and the verdict flips when a measurement says otherwise."""
    text = report.owner_claim_report(walk)
    assert "`all_gather_into_tensor`, `reduce_scatter_tensor`" in text
    assert "- ✗" not in text and text.count("- ✓") == 5 and "wrong on every point" in text
    n = walk["world_size"]
    assert f"each of the {n} ranks held a different" in text

    broken = copy.deepcopy(walk)  # a rank that kept its gathered unit and a broadcast
    broken["stages"]["free"]["unsharded_storage_bytes"][1] = 64
    broken["stages"]["gather"]["collectives"][0] = ["broadcast"]
    text = report.owner_claim_report(broken)
    assert text.count("- ✗") == 2 and "wrong on every point" not in text
    assert "storage after `free`, per rank" in text and "broadcast" in text
