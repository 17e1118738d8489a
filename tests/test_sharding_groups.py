"""A unit of several sibling modules (the tied embedding and head as one unit): training equals
single-process training and FSDP2's ``fully_shard([tok_emb, head])``; the unit is gathered once
per member call and freed in between, in forward and in backward; prefetch follows the calls."""

from __future__ import annotations

import pytest
import torch

import fsdp_lab
from fsdp_lab import comm, reference
from fsdp_lab.cluster import intra_op_threads
from fsdp_lab.models import Block, tiny_gpt
from fsdp_lab.sharding import shard
from fsdp_lab.sharding.ties import verify_weight_tying
from fsdp_lab.trace import MemoryTracker

BLOCKS = [f"blocks.{i}" for i in range(4)]
JOINT = ("tok_emb", "head")
STEPS = 10
LR = 0.1  # SGD with momentum, as in test_sharding: holds rtol 1e-5 against reordered sums


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


# The trainings run on one thread per rank: several ranks with torch's default thread count
# on a few cores spin against each other, several times slower
# (`fsdp_lab.cluster.rank_threads`); values and bytes are the same.
ONE_THREAD = intra_op_threads(1)


@ONE_THREAD
def _train(system: str, strategy: str, prefetch: bool) -> dict[str, torch.Tensor]:
    r, n = fsdp_lab.rank(), fsdp_lab.world_size()
    model = tiny_gpt()
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (n,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard([model.tok_emb, model.head], mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = shard(model, units=[*BLOCKS, JOINT], strategy=strategy, prefetch=prefetch)
    reference.train_steps(model, _sgd(model.parameters()), STEPS, rank=r, world=n)
    if system != "fsdp2":
        assert verify_weight_tying(model) == []
    return reference.full_parameters(model)


@pytest.fixture(scope="module")
def single_process() -> dict[str, torch.Tensor]:
    model = tiny_gpt()
    reference.train_steps(model, _sgd(model.parameters()), STEPS)
    return {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("n", [2, 3])
def test_joint_unit_matches_single_process_and_fsdp2(cluster_of, single_process, n):
    cluster = cluster_of(n)
    runs = {
        "fsdp2": cluster.run(_train, "fsdp2", "full", True),
        "full": cluster.run(_train, "ours", "full", True),
        "full, no prefetch": cluster.run(_train, "ours", "full", False),
        "grad_op": cluster.run(_train, "ours", "grad_op", True),
    }
    for name, per_rank in runs.items():
        for r, params in enumerate(per_rank):
            assert set(params) == set(single_process)
            for key, expected in single_process.items():
                torch.testing.assert_close(
                    params[key], expected, rtol=1e-5, atol=1e-6, msg=f"{name} {key} rank {r}"
                )
                torch.testing.assert_close(params[key], runs["fsdp2"][r][key], rtol=1e-5, atol=1e-6)
            assert torch.equal(params["tok_emb.weight"], params["head.weight"]), name
    moved = single_process["tok_emb.weight"] - tiny_gpt().tok_emb.weight
    assert moved.abs().max() > 1e-3  # training really changed the tied matrix


def _joint_events(prefetch: bool) -> dict:
    """Markers and bytes of the second step (orders recorded, prefetch active)."""
    model = shard(tiny_gpt(), units=[*BLOCKS, JOINT], strategy="full", prefetch=prefetch)
    opt = _sgd(model.parameters())
    r, n = fsdp_lab.rank(), fsdp_lab.world_size()
    reference.train_steps(model, opt, 1, rank=r, world=n)
    with MemoryTracker() as mem, comm.CommLog() as log:
        mem.track(model)
        reference.train_steps(model, opt, 1, rank=r, world=n)
    labels = [m["label"] for m in mem.trace()["markers"]]
    joint = sum(p.numel() for p in tiny_gpt().tok_emb.parameters())  # the head adds none
    return {"labels": labels, "bytes": log.bytes_by_op(), "calls": log.calls_by_op(), "j": joint}


@pytest.mark.parametrize("prefetch", [False, True])
def test_joint_unit_is_gathered_per_member_call_and_freed_in_between(cluster_of, prefetch):
    for res in cluster_of(2).run(_joint_events, prefetch):
        labels = res["labels"]
        forward = labels[: labels.index("step 0 forward done")]
        backward = labels[
            labels.index("step 0 forward done") : labels.index("step 0 backward done")
        ]
        joint = [lab for lab in forward if lab.endswith("tok_emb+head")]
        # Forward: gathered for the embedding, freed before the blocks, gathered for the head.
        assert joint == [
            "all-gather tok_emb+head",
            "free tok_emb+head",
            "all-gather tok_emb+head",
            "free tok_emb+head",
        ]
        first_free = forward.index("free tok_emb+head")
        second_gather = forward.index("all-gather tok_emb+head", first_free)
        between = forward[first_free:second_gather]
        assert all(f"all-gather {b}" in between for b in BLOCKS)
        # Backward: gathered for the head, freed while the blocks run, gathered for the
        # embedding, freed (as FSDP2: the gradient is its own tensor), then one reduce-scatter
        # of the summed gradient at the very end.
        joint = [lab for lab in backward if lab.endswith("tok_emb+head")]
        assert joint == [
            "all-gather tok_emb+head",
            "free tok_emb+head",
            "all-gather tok_emb+head",
            "free tok_emb+head",
            "reduce-scatter tok_emb+head",
        ]
        # Bytes: 4 gathers of the joint unit per step (2 forward + 2 backward), one
        # reduce-scatter; the blocks as usual (2 gathers, 1 reduce-scatter), the root gathered
        # once (it stays gathered from forward into backward).
        assert res["calls"] == {"all_gather_into_tensor": 4 + 2 * 4 + 1, "reduce_scatter_tensor": 6}


def _collected_after_drop(strategy: str) -> bool:
    import gc
    import weakref

    model = shard(tiny_gpt(), units={Block}, strategy=strategy)
    reference.train_steps(
        model, _sgd(model.parameters()), 1, world=fsdp_lab.world_size(), rank=fsdp_lab.rank()
    )
    shard_param = weakref.ref(next(model.parameters()))
    del model
    gc.collect()
    return shard_param() is None


@pytest.mark.parametrize("strategy", ["full", "none"])  # "none": DDP's buckets hook each parameter
def test_a_sharded_model_is_freed_when_dropped(cluster_of, strategy):
    # A hook holding the unit strongly on the buffer's C++ side would keep every sharded model
    # (its shards) alive on a long-lived rank, run after run.
    assert cluster_of(2).run(_collected_after_drop, strategy) == [True, True]
