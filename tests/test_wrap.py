"""Wrap plans: which parameters each unit gathers, and the plans that must be refused.

Expected unit contents are worked out from the model's structure and parameter counts,
never read back from `build_plan` itself.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch.nn as nn

from fsdp_lab.models import MLP, Block, MLPBlock, MLPStack, tiny_gpt
from fsdp_lab.sharding.wrap import MinParams, PlanError, WrapPlan, build_plan, unit_sizes

N_LAYERS = 4
BLOCKS = tuple(f"blocks.{i}" for i in range(N_LAYERS))


@pytest.fixture
def gpt():
    return tiny_gpt(n_layers=N_LAYERS)


def names_in(plan: WrapPlan, unit: str) -> set[str]:
    return {r.name for r in plan.params[unit]}


def own_param_names(model: nn.Module, prefix: str) -> set[str]:
    """Fully qualified names of every parameter under `prefix` (a module name)."""
    return {f"{prefix}.{n}" for n, _ in model.get_submodule(prefix).named_parameters()}


def numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# -- a set of module classes ---------------------------------------------------------------------


def test_block_plan_units_in_module_order(gpt):
    plan = build_plan(gpt, {Block})
    assert plan.units == ("", *BLOCKS)


def test_block_plan_root_unit_holds_embeddings_and_final_norm(gpt):
    plan = build_plan(gpt, {Block})
    assert names_in(plan, "") == {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias"}
    (tied,) = [r for r in plan.params[""] if r.name == "tok_emb.weight"]
    assert set(tied.owners) == {("tok_emb", "weight"), ("head", "weight")}
    untied = [r for r in plan.params[""] if r.name != "tok_emb.weight"]
    assert all(len(r.owners) == 1 for r in untied)


def test_block_plan_each_block_unit_holds_exactly_its_block(gpt):
    plan = build_plan(gpt, {Block})
    for b in BLOCKS:
        assert names_in(plan, b) == own_param_names(gpt, b)
        assert len(plan.params[b]) == len(list(gpt.get_submodule(b).parameters()))


def test_every_parameter_in_exactly_one_unit_tied_once(gpt):
    plan = build_plan(gpt, {Block})
    listed = Counter(r.name for u in plan.units for r in plan.params[u])
    assert all(count == 1 for count in listed.values()), listed
    # named_parameters() lists a tied Parameter once, under its first name.
    assert set(listed) == {n for n, _ in gpt.named_parameters()}
    lookup = dict(gpt.named_parameters(remove_duplicate=False))
    ids = [id(lookup[name]) for name in listed]
    assert len(set(ids)) == len(ids) == len({id(p) for p in gpt.parameters()})


def test_unit_sizes_count_tied_weight_once(gpt):
    plan = build_plan(gpt, {Block})
    sizes = unit_sizes(plan, gpt)
    c = gpt.config
    root = c.vocab_size * c.dim + c.seq_len * c.dim + 2 * c.dim  # tok_emb (=head), pos, ln_f
    d = c.dim
    block = 2 * (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    assert sizes == {"": root, **{b: block for b in BLOCKS}}
    assert sum(sizes.values()) == sum(p.numel() for p in gpt.parameters())
    # The head is not counted a second time: the tied matrix appears once in the total.
    every_owner = sum(p.numel() for _, p in gpt.named_parameters(remove_duplicate=False))
    assert sum(sizes.values()) == every_owner - c.vocab_size * c.dim


def test_nested_units_mlp_params_go_to_the_mlp_unit(gpt):
    plan = build_plan(gpt, {Block, MLP})
    expected_units = [""]
    for b in BLOCKS:
        expected_units += [b, f"{b}.mlp"]
    assert plan.units == tuple(expected_units)
    for b in BLOCKS:
        mlp = own_param_names(gpt, f"{b}.mlp")
        assert names_in(plan, f"{b}.mlp") == mlp
        assert names_in(plan, b) == own_param_names(gpt, b) - mlp
        assert names_in(plan, b) >= {f"{b}.ln1.weight", f"{b}.attn.qkv.weight", f"{b}.ln2.bias"}


def test_mlp_stack_block_plan_leaves_embedding_and_head_to_root():
    model = MLPStack(vocab_size=16, dim=8, n_layers=3)
    plan = build_plan(model, {MLPBlock})
    assert plan.units == ("", "blocks.0", "blocks.1", "blocks.2")
    assert names_in(plan, "") == {"emb.weight", "head.weight", "head.bias"}


# -- names, policies, sizes ----------------------------------------------------------------------


def test_explicit_names_are_put_in_module_order(gpt):
    plan = build_plan(gpt, ["blocks.1", "blocks.0"])
    assert plan.units == ("", "blocks.0", "blocks.1")
    # Blocks nobody named fall to the root unit.
    assert names_in(plan, "") >= own_param_names(gpt, "blocks.2") | own_param_names(gpt, "blocks.3")
    assert names_in(plan, "blocks.1") == own_param_names(gpt, "blocks.1")


def test_policy_callable_selects_the_mlps(gpt):
    plan = build_plan(gpt, lambda name, m: name.endswith("mlp"))
    assert plan.units == ("", *(f"{b}.mlp" for b in BLOCKS))
    for b in BLOCKS:
        assert names_in(plan, f"{b}.mlp") == own_param_names(gpt, f"{b}.mlp")


def test_no_plan_is_one_root_unit(gpt):
    plan = build_plan(gpt)
    assert plan.units == ("",)
    assert names_in(plan, "") == {n for n, _ in gpt.named_parameters()}


def test_min_params_between_mlp_and_block_size_picks_the_blocks(gpt):
    block0 = gpt.blocks[0]
    mlp_size, block_size = numel(block0.mlp), numel(block0)
    largest_other = max(
        numel(m)
        for n, m in gpt.named_modules()
        if n and not isinstance(m, Block) and not isinstance(m, (nn.ModuleList, MLP))
    )
    assert largest_other < mlp_size < block_size  # the premise of the threshold below
    threshold = (mlp_size + block_size) // 2
    # Bottom-up: no leaf and no MLP reaches the threshold; each Block does (12704 >= it), and
    # then nothing is left unclaimed in `blocks`; the embeddings, head, ln_f are far smaller.
    plan = build_plan(gpt, MinParams(threshold))
    assert plan.units == ("", *BLOCKS)
    assert names_in(plan, "") == {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias"}


def test_min_params_above_the_whole_model_leaves_only_the_root(gpt):
    plan = build_plan(gpt, MinParams(numel(gpt) + 1))
    assert plan.units == ("",)


@pytest.mark.parametrize("where", ["between_fc_and_mlp", "above_block"])
def test_min_params_never_makes_a_container_without_forward_a_unit(gpt, where):
    block0 = gpt.blocks[0]
    if where == "between_fc_and_mlp":
        # Leaves < threshold <= MLP: every MLP is a unit; what is left of a block (two norms and
        # the attention) is below the threshold and, summed over the ModuleList, above it.
        threshold = (numel(block0.mlp.fc) + numel(block0.mlp)) // 2
        expected = ("", *(f"{b}.mlp" for b in BLOCKS))
    else:
        # Above one block, below all four: no module with a forward reaches it but the root.
        threshold = numel(block0) + 1
        expected = ("",)
    plan = build_plan(gpt, MinParams(threshold))
    assert not any(isinstance(gpt.get_submodule(u), nn.ModuleList) for u in plan.units if u)
    assert plan.units == expected


def test_named_container_without_forward_is_refused(gpt):
    with pytest.raises(PlanError, match=r"'blocks'"):
        build_plan(gpt, ["blocks"])


def test_min_params_below_head_size_keeps_the_tie_in_one_unit(gpt):
    threshold = numel(gpt.head) // 2
    plan = build_plan(gpt, MinParams(threshold))
    assert "tok_emb.weight" in names_in(plan, "")


@pytest.mark.parametrize("bad", [0, -5])
def test_min_params_must_be_positive(gpt, bad):
    with pytest.raises(PlanError, match=rf"MinParams\({bad}\)"):
        build_plan(gpt, MinParams(bad))


# -- tied weights --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("units", "unit_of_head", "unit_of_emb"),
    [
        (["head"], "'head'", "'' (root)"),
        ({nn.Linear}, "'head'", "'' (root)"),
        (["tok_emb"], "'' (root)", "'tok_emb'"),
    ],
)
def test_tie_split_across_units_is_refused(gpt, units, unit_of_head, unit_of_emb):
    with pytest.raises(PlanError) as info:
        build_plan(gpt, units)
    msg = str(info.value)
    assert "'tok_emb.weight'" in msg
    assert "'tok_emb'" in msg and "'head'" in msg
    assert f"'head' -> unit {unit_of_head}" in msg
    assert f"'tok_emb' -> unit {unit_of_emb}" in msg
    assert "one unit" in msg and "root unit" in msg


class TiedPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


class WithTiedPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.pair = TiedPair()
        self.out = nn.Linear(4, 4)


@pytest.mark.parametrize("units", [["pair"], {TiedPair}, ["inp", "pair", "out"]])
def test_tie_inside_one_unit_is_accepted(units):
    model = WithTiedPair()
    plan = build_plan(model, units)
    assert "pair" in plan.units
    (ref,) = plan.params["pair"]
    assert ref.name == "pair.emb.weight"
    assert set(ref.owners) == {("pair.emb", "weight"), ("pair.head", "weight")}
    assert unit_sizes(plan, model)["pair"] == 10 * 4


def test_tie_inside_a_unit_split_by_nested_units_is_refused():
    with pytest.raises(PlanError, match=r"'pair\.emb\.weight'"):
        build_plan(WithTiedPair(), ["pair", "pair.head"])


# -- plans that cannot work ----------------------------------------------------------------------


def test_unknown_module_name_is_named_with_a_close_match(gpt):
    with pytest.raises(PlanError) as info:
        build_plan(gpt, ["blocks.0", "blocks.9"])
    msg = str(info.value)
    assert "'blocks.9'" in msg
    assert "did you mean" in msg and any(f"'{b}'" in msg.split("did you mean")[1] for b in BLOCKS)


class WithIdentity(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.noop = nn.Identity()
        self.wrapper = nn.Sequential(nn.Linear(3, 3))


@pytest.mark.parametrize(
    ("units", "empty"),
    [
        (["noop"], "noop"),
        ({nn.Identity}, "noop"),
        (["wrapper", "wrapper.0"], "wrapper"),  # its only child took all its parameters
    ],
)
def test_unit_without_parameters_of_its_own_is_refused(units, empty):
    with pytest.raises(PlanError) as info:
        build_plan(WithIdentity(), units)
    assert f"{empty!r}" in str(info.value)
    assert "no parameters" in str(info.value)


def test_a_parent_with_parameters_beside_a_unit_child_is_fine():
    plan = build_plan(WithIdentity(), ["wrapper.0"])
    assert plan.units == ("", "wrapper.0")
    assert names_in(plan, "") == {"lin.weight", "lin.bias"}


@pytest.mark.parametrize("units", ["garbage", 42, [Block, "blocks.0"], 3.5])
def test_unrecognised_plan_explains_the_accepted_forms(gpt, units):
    with pytest.raises(PlanError) as info:
        build_plan(gpt, units)
    msg = str(info.value)
    for form in ("module classes", "module names", "callable", "MinParams", "WrapPlan"):
        assert form in msg


def test_plan_error_is_a_value_error():
    assert issubclass(PlanError, ValueError)


# -- a plan as input, and its description --------------------------------------------------------


@pytest.mark.parametrize("units", [{Block}, {Block, MLP}, ["blocks.2"], None])
def test_wrap_plan_round_trips(gpt, units):
    plan = build_plan(gpt, units)
    again = build_plan(gpt, plan)
    assert again == plan
    assert again.units == plan.units


def test_wrap_plan_on_a_model_missing_its_units_is_refused(gpt):
    plan = build_plan(gpt, {Block})
    with pytest.raises(PlanError, match=r"'blocks\.2'"):
        build_plan(tiny_gpt(n_layers=2), plan)


def test_describe_mentions_every_unit_and_parameter(gpt):
    plan = build_plan(gpt, {Block, MLP})
    text = plan.describe()
    lines = text.splitlines()
    assert len(lines) == len(plan.units)
    assert "(root)" in lines[0] and "tok_emb.weight" in lines[0]
    for unit, line in zip(plan.units[1:], lines[1:], strict=True):
        assert repr(unit) in line
        assert f"{len(plan.params[unit])} parameter" in line
        assert all(r.name in line for r in plan.params[unit])
