"""The meta-init lab's exercises: the reference passes every case, each classic bug fails with
the hint that names it; and the mechanism's injection points (`init_param_shards`'s
``slice_fn=``, `to_empty_tied`'s ``retie_fn=``) behave as the exercises rely on."""

from __future__ import annotations

import pytest
import torch

from fsdp_lab import course
from fsdp_lab.meta_init.counter_init import DeterministicInit, build_on_meta, init_param_shards
from fsdp_lab.meta_init.exercises import EXERCISES
from fsdp_lab.meta_init.exercises import param_shard as meta_init
from fsdp_lab.meta_init.exercises import retie as meta_retie
from fsdp_lab.models import tiny_gpt
from fsdp_lab.sharding.ties import to_empty_tied


@pytest.mark.parametrize("world", [1, 3, 4])
def test_param_shards_add_up_to_the_one_process_init_bitwise(world):
    model, _ = build_on_meta(lambda: tiny_gpt(n_layers=1))
    init = DeterministicInit(5)
    pieces = [init_param_shards(model, init, r, world) for r in range(world)]
    for name, p in model.named_parameters():
        flat = torch.cat([piece[name] for piece in pieces])
        assert len(flat) % world == 0 and len(flat) - p.numel() < world
        assert torch.equal(flat[: p.numel()], init.values(name, tuple(p.shape), 0, p.numel()))
        assert not flat[p.numel() :].any()  # the padding is zeros


def test_to_empty_tied_keeps_the_tie_and_plain_to_empty_does_not():
    model, _ = build_on_meta(lambda: tiny_gpt(n_layers=1))
    to_empty_tied(model, "cpu")
    assert model.head.weight is model.tok_emb.weight and not model.head.weight.is_meta
    model, _ = build_on_meta(lambda: tiny_gpt(n_layers=1))
    to_empty_tied(model, "cpu", retie_fn=lambda m, ties: None)
    assert model.head.weight is not model.tok_emb.weight


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.name)
def test_the_reference_passes_every_case(exercise_pool, exercise):
    v = course.grade(exercise.name, exercise.solution, exercise_pool)
    assert v.passed, v.to_text()
    assert len(v.passed_cases) == len(exercise.cases)


@pytest.mark.parametrize(
    ("slug", "case", "hint"),
    [
        ("stream-start", "2 ranks", "from the start of the stream"),
        ("inclusive-end", "2 ranks", "Off by one"),
        ("even-split", "3 ranks", "starts at element 11, but equal padded pieces start it at 12"),
        ("whole-tensor", "2 ranks", "never values(name, shape, 0, numel)"),
    ],
)
def test_each_param_shard_bug_fails_with_its_own_hint(exercise_pool, slug, case, hint):
    v = course.grade("param_shard", meta_init.PARAM_SHARD.bug(slug).wrong, exercise_pool)
    assert v.kind == "wrong result" and v.score == 0
    assert v.case.startswith(case) and hint in v.hint, v.to_text()
    if slug == "whole-tensor":  # measured: every rank's peak above the reference's
        lines = v.series["lines"]
        assert all(y > r for y, r in zip(lines["yours"], lines["reference"], strict=True))


@pytest.mark.parametrize(
    ("slug", "case", "hint"),
    [
        ("forgot", "2 ranks, tied GPT", "to_empty gave every owner a new Parameter"),
        ("storage", "2 ranks, tied GPT", "storage tie"),
        ("first-tie-only", "3 ranks, two ties", "re-tie every tie"),
    ],
)
def test_each_retie_bug_fails_with_its_own_hint(exercise_pool, slug, case, hint):
    v = course.grade("retie", meta_retie.RETIE.bug(slug).wrong, exercise_pool)
    assert v.kind == "wrong result" and v.score == 0
    assert v.case.startswith(case) and hint in v.hint, v.to_text()
    rows = {r[0]: (r[1], r[2]) for r in v.rows}
    assert rows["shard()"] == ("accepted", "refused")
    expected_tensors, got_tensors = map(int, rows["parameter tensors"])
    assert got_tensors > expected_tensors  # one Parameter more per broken tie
    expected_bytes, got_bytes = map(int, rows["bytes of their storages (measured)"])
    # Two storages where one was meant costs its bytes again; a shared storage does not.
    assert (got_bytes == expected_bytes) == (slug == "storage")
    assert len(v.series["lines"]["yours"]) == meta_retie.STEPS
