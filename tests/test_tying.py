"""tying: ties are found (identity and storage, on meta too), re-established after being
broken, and verified on unsharded and sharded models, before and after training."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp_lab
from fsdp_lab import reference
from fsdp_lab.models import Block, tiny_gpt
from fsdp_lab.sharding import shard
from fsdp_lab.sharding.ties import (
    Tie,
    assert_tied,
    find_ties,
    record_ties,
    recorded_ties,
    retie,
    verify_weight_tying,
)

GPT_TIE = ("tok_emb.weight", "head.weight")


class _SharedStorage(nn.Module):
    """`b` is a distinct Parameter over the first 4 elements of `a`'s storage."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 2)
        self.second = nn.Module()
        self.second.b = nn.Parameter(self.first.weight.data.view(-1)[:4])


def test_find_ties_on_tiny_gpt_is_the_embedding_head_identity_tie():
    ties = find_ties(tiny_gpt())
    assert ties == [Tie(GPT_TIE, ("tok_emb", "head"), "identity", (64, 32))]


def test_find_ties_sees_shared_storage():
    model = _SharedStorage()
    (tie,) = find_ties(model)
    assert tie.kind == "storage"
    assert tie.names == ("first.weight", "second.b")
    assert tie.modules == ("first", "second")
    model.second.b.data = model.second.b.data.clone()  # its own storage now: no tie
    assert find_ties(model) == []


def test_find_ties_on_meta_reports_identity_only():
    with torch.device("meta"):
        gpt = tiny_gpt()
        shared = _SharedStorage()
    assert [t.names for t in find_ties(gpt)] == [GPT_TIE]
    # Meta tensors have no storage: every data pointer is 0, which must not read as one tie.
    assert find_ties(shared) == []


def test_record_and_retie_round_trip():
    model = tiny_gpt()
    ties = record_ties(model)
    assert recorded_ties(model) == ties
    model.head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())  # untie by hand
    assert find_ties(model) == []
    assert recorded_ties(model) == ties  # the record outlives the tie
    retie(model, recorded_ties(model))
    assert model.head.weight is model.tok_emb.weight
    assert verify_weight_tying(model) == []


def test_retie_refuses_mismatched_shapes_naming_both():
    model = tiny_gpt()
    ties = record_ties(model)
    model.head.weight = nn.Parameter(torch.zeros(3, 5))
    with pytest.raises(ValueError) as err:
        retie(model, ties)
    for fragment in ("'tok_emb.weight'", "'head.weight'", "(64, 32)", "(3, 5)"):
        assert fragment in str(err.value)
    assert model.head.weight.shape == (3, 5)  # nothing was changed


def test_verify_names_both_parameters_of_a_broken_tie():
    model = tiny_gpt()
    record_ties(model)
    assert verify_weight_tying(model) == []
    model.head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())
    problems = verify_weight_tying(model)
    assert len(problems) == 1
    assert "'tok_emb.weight'" in problems[0] and "'head.weight'" in problems[0]
    with pytest.raises(ValueError, match="head.weight"):
        assert_tied(model)


def _verify_sharded() -> dict:
    model = tiny_gpt()
    record_ties(model)
    model = shard(model, units={Block})
    right_after = verify_weight_tying(model)
    # One slice Parameter under both names (per-parameter views): the tie is visible at once.
    one_slice = model.head.weight is model.tok_emb.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference.train_steps(model, opt, 3, rank=fsdp_lab.rank(), world=fsdp_lab.world_size())
    after_steps = verify_weight_tying(model)
    same_view = model.head.weight is model.tok_emb.weight
    # Break the tie by hand: the object check must notice.
    model.head.weight = torch.nn.Parameter(torch.zeros_like(model.tok_emb.weight))
    broken = verify_weight_tying(model)
    return {
        "right_after": right_after,
        "one_slice": one_slice,
        "after_steps": after_steps,
        "same_view": same_view,
        "broken": broken,
    }


def _verify_flat() -> dict:
    model = tiny_gpt()
    record_ties(model)
    model = shard(model, units={Block}, use_orig_params=False)
    head_before = getattr(model.head, "weight", None)  # the flat view: no attribute until used
    reference.train_steps(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        1,
        rank=fsdp_lab.rank(),
        world=fsdp_lab.world_size(),
    )
    # zeros_like, not clone: the views point into a freed buffer, 0 bytes.
    model.head.weight = torch.zeros_like(model.tok_emb.weight)
    return {"head_before": head_before, "broken": verify_weight_tying(model)}


def test_verify_on_a_sharded_tiny_gpt_before_and_after_training(cluster_of):
    for res in cluster_of(2).run(_verify_sharded):
        assert res["right_after"] == []
        assert res["one_slice"]
        assert res["after_steps"] == []
        assert res["same_view"]
        assert len(res["broken"]) == 1 and "'head.weight'" in res["broken"][0]
    for res in cluster_of(2).run(_verify_flat):
        assert res["head_before"] is None  # not gathered yet: only the segment check ran
        assert len(res["broken"]) == 1 and "'head.weight'" in res["broken"][0]


def test_verify_on_a_sharded_model_flags_a_tie_outside_one_segment(cluster_of):
    def split_tie() -> list[str]:
        model = shard(tiny_gpt(), units={Block})
        fake = Tie(("tok_emb.weight", "blocks.0.ln1.weight"), ("tok_emb", "blocks.0.ln1"), "x", ())
        return verify_weight_tying(model, [fake])

    for problems in cluster_of(2).run(split_tie):
        assert len(problems) == 1 and "split over flat segments" in problems[0]


def test_shard_refuses_a_storage_tie_naming_both_parameters():
    # Two Parameter objects over one storage would become two flat segments: two copies.
    with pytest.raises(ValueError, match=r"first\.weight.*second\.b.*identity tie"):
        shard(_SharedStorage())
