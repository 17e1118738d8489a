"""The sharding lab's exercises, run inside the real sharded units: the reference passes every
case; each classic bug fails with the hint that names it, on the case that exposes it, with
the measured symptom (a loss that drifts, a memory trace that never drops, the all-gathers
backward waited for)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_lab import comm, course
from fsdp_lab.sharding.exercises import free_unsharded as sharding_memory
from fsdp_lab.sharding.exercises import reduce_scatter_grad as sharding
from fsdp_lab.sharding.exercises import unit_to_prefetch as sharding_prefetch


@pytest.mark.parametrize(
    "exercise",
    [
        sharding.REDUCE_SCATTER_GRAD,
        sharding_memory.FREE_UNSHARDED,
        sharding_prefetch.UNIT_TO_PREFETCH,
        course.exercise("cast_floats"),
    ],
    ids=lambda e: e.name,
)
def test_the_reference_passes_every_case(exercise_pool, exercise):
    v = course.grade(exercise.name, exercise.solution, exercise_pool)
    assert v.passed, v.to_text()
    assert len(v.passed_cases) == len(exercise.cases)


def _divide_first(full_grad, group):
    """Dividing before the sum is the same mean, up to float reordering: not a bug."""
    n = dist.get_world_size(group)
    out = torch.empty(full_grad.numel() // n, dtype=full_grad.dtype)
    comm.reduce_scatter_tensor(out, full_grad / n, group=group)
    return out


@pytest.mark.parametrize(
    ("slug", "case", "hint", "series"),
    [
        ("no-divide", "2 ranks", "missing ÷ world size", "loss"),
        ("other-chunk", "2 ranks", "you returned rank 1's chunk", "loss"),
        ("all-reduce", "2 ranks", "an all-reduce sends every rank the whole sum", None),
    ],
)
def test_each_reduce_bug_fails_with_its_own_hint(exercise_pool, slug, case, hint, series):
    bug = sharding.REDUCE_SCATTER_GRAD.bug(slug)
    v = course.grade("reduce_scatter_grad", bug.wrong, exercise_pool)
    assert v.kind == "wrong result" and v.score == 0, v.to_text()
    assert v.case.startswith(case) and hint in v.hint, v.to_text()
    if series:  # the loss drifts from the reference's, step by step
        lines = v.series["lines"]
        assert len(lines["yours"]) == sharding.STEPS and lines["yours"] != lines["reference"]
    else:
        assert v.summary.startswith("values right, but") and "2x the bytes" in v.summary


def test_never_freeing_shows_a_memory_trace_that_never_drops(exercise_pool):
    bug = sharding_memory.FREE_UNSHARDED.bug("never-frees")
    v = course.grade("free_unsharded", bug.wrong, exercise_pool)
    assert v.kind == "wrong result" and v.summary.startswith("values right, but"), v.to_text()
    assert "resize_(0)" in v.hint
    ref, yours = v.series["lines"]["reference"], v.series["lines"]["yours"]
    assert v.series["bytes"] and len(ref) == len(yours)
    # Measured: the reference stays flat through the blocks' forwards (each freed after its
    # own), the learner's grows by a unit at every block.
    blocks = 3
    assert len(set(ref[:blocks])) == 1
    assert yours[:blocks] == sorted(yours[:blocks]) and len(set(yours[:blocks])) == blocks


def test_zeroing_instead_of_freeing_is_caught_by_the_gradients(exercise_pool):
    bug = sharding_memory.FREE_UNSHARDED.bug("zeroes")
    v = course.grade("free_unsharded", bug.wrong, exercise_pool)
    assert v.kind == "wrong result" and "backward computed with zeros" in v.summary, v.to_text()
    assert "still looks gathered" in v.hint, v.hint
    held = dict((what, got) for what, _, got in v.rows)
    assert "zeros" in held.values(), v.rows


@pytest.mark.parametrize(
    ("slug", "symptom", "hint"),
    [
        ("forward-next", "gathered 3 unit(s) it did not need", "forward order's next unit"),
        ("two-ahead", "at the peak", "off by one: position - 2"),
        ("itself", "waited for 4 all-gather(s)", "whose backward is running"),
    ],
)
def test_each_prefetch_bug_keeps_the_values_and_shows_the_waits(exercise_pool, slug, symptom, hint):
    bug = sharding_prefetch.UNIT_TO_PREFETCH.bug(slug)
    v = course.grade("unit_to_prefetch", bug.wrong, exercise_pool)
    assert v.kind == "wrong result" and v.summary.startswith("values right, but"), v.to_text()
    assert symptom in v.summary and hint in v.hint, v.to_text()
    assert v.series is not None and v.series["lines"]["yours"] != v.series["lines"]["reference"]


def test_a_prefetch_of_an_unknown_unit_is_a_wrong_output(exercise_pool):
    v = course.grade("unit_to_prefetch", lambda order, position: "blocks.9", exercise_pool)
    assert v.kind == "wrong output" and "'blocks.9'" in v.summary, v.to_text()


# -- cast_floats: one model in two precisions (issue 37) -------------------------------------


def _cast_by_hand(tree, dtype):
    """A walk written out by hand, not with pytree: the same casts, so it passes."""
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, (tuple, list)):
        return type(tree)(_cast_by_hand(t, dtype) for t in tree)
    if isinstance(tree, dict):
        return {k: _cast_by_hand(v, dtype) for k, v in tree.items()}
    return tree


@pytest.mark.parametrize(
    ("name", "fn"),
    [("reduce_scatter_grad", _divide_first), ("cast_floats", _cast_by_hand)],
    ids=["dividing before the sum", "a walk written by hand"],
)
def test_a_right_answer_that_is_not_the_references_passes(exercise_pool, name, fn):
    v = course.grade(name, fn, exercise_pool)
    assert v.passed, v.to_text()


@pytest.mark.parametrize(
    ("slug", "summary", "row", "hint"),
    [
        ("every-tensor", "the forward failed", ("Embedding computed on", "int64", "float16"),
         "args[0]: an int64 tensor came back float16: the token ids were cast too"),
        ("bare-tensor-only", "expected m1 and m2 to have the same dtype",
         ("RMSNorm computed on", "float32", "float16"),
         "args[0]: a float16 tensor came back float16, float32 asked: a unit's inputs arrive as "
         "(args, kwargs)"),
        ("fixed-dtype", "expected m1 and m2 to have the same dtype",
         ("Linear computed on", "float16", "bfloat16"),
         "a float16 tensor came back bfloat16, float32 asked: cast to the `dtype` argument"),
    ],
)  # fmt: skip
def test_each_cast_bug_fails_with_the_dtype_each_module_computed_on(
    exercise_pool, slug, summary, row, hint
):
    from fsdp_lab.sharding.exercises.cast_floats import CAST_FLOATS

    v = course.grade("cast_floats", CAST_FLOATS.bug(slug).wrong, exercise_pool)
    assert v.kind == "wrong result" and v.score == 0, v.to_text()
    assert v.case.startswith("2 ranks") and summary in v.summary, v.to_text()
    assert row in [tuple(r) for r in v.rows] and hint in v.hint, v.to_text()


def test_a_cast_that_cuts_the_graph_shows_the_gradients_it_lost(exercise_pool):
    def detached(tree, dtype):
        cast = lambda t: t.detach().to(dtype) if t.is_floating_point() else t  # noqa: E731
        return torch.utils._pytree.tree_map_only(torch.Tensor, cast, tree)

    v = course.grade("cast_floats", detached, exercise_pool)
    assert v.kind == "wrong result" and "training differs" in v.summary, v.to_text()
    rows = {label: (want, got) for label, want, got in v.rows}
    want, got = rows["gradient norms, first values"]
    assert got.startswith("0, 0,") and not want.startswith("0, ")
    assert "cut from autograd's graph" in v.hint


def test_returning_nothing_is_a_wrong_output_not_a_model_error(exercise_pool):
    v = course.grade("cast_floats", lambda tree, dtype: None, exercise_pool)
    assert v.kind == "wrong output" and "returned None" in v.summary, v.to_text()


def _walk(tree, dtype, depth=0, *, limit=None, tensor=None, container=None):
    """A hand-written walk with one thing wrong, as a hostile review's functions had."""
    if isinstance(tree, torch.Tensor):
        return tensor(tree, dtype) if tensor else _cast_by_hand(tree, dtype)
    if limit is not None and depth >= limit:
        return tree
    walk = lambda t: _walk(t, dtype, depth + 1, limit=limit, tensor=tensor, container=container)  # noqa: E731
    if isinstance(tree, (tuple, list)):
        return (container or type(tree))(walk(t) for t in tree)
    if isinstance(tree, dict):
        return {k: walk(v) for k, v in tree.items()}
    return tree


# Each passed with full points before the check's model called a unit with keyword arguments,
# a list, a dict, numbers and fp32 buffers, and before each cast was held to its contract.
PASSED_BEFORE = {
    "walks two levels only": lambda tree, dtype: _walk(tree, dtype, limit=2),
    "rebuilds tuples as lists": lambda tree, dtype: _walk(tree, dtype, container=list),
    "turns ids into int32": lambda tree, dtype: _walk(
        tree, dtype, tensor=lambda t, d: t.to(d) if t.is_floating_point() else t.int()
    ),
    "casts only tensors that need a gradient": lambda tree, dtype: _walk(
        tree, dtype, tensor=lambda t, d: t.to(d) if t.requires_grad else t
    ),
    "never casts a bare tensor (the outputs)": lambda tree, dtype: (
        tree if isinstance(tree, torch.Tensor) else _cast_by_hand(tree, dtype)
    ),
    "drops the keyword arguments": lambda tree, dtype: (_cast_by_hand(tree[0], dtype), {})
    if isinstance(tree, tuple) else _cast_by_hand(tree, dtype),
}  # fmt: skip


@pytest.mark.parametrize("what", PASSED_BEFORE)
def test_a_cast_that_breaks_its_contract_fails_and_says_where(exercise_pool, what):
    v = course.grade("cast_floats", PASSED_BEFORE[what], exercise_pool)
    assert v.kind == "wrong result" and v.score == 0, (what, v.to_text())
    assert v.hint.startswith(("args", "kwargs", "the output", "the tree")), v.hint


def test_a_function_that_changed_torchs_defaults_does_not_fail_the_next_one(exercise_pool):
    def sets_float64(tree, dtype):
        torch.set_default_dtype(torch.float64)
        return _cast_by_hand(tree, dtype)

    course.grade("cast_floats", sets_float64, exercise_pool)
    v = course.grade("cast_floats", _cast_by_hand, exercise_pool)
    assert v.passed, v.to_text()
