"""Models nobody here wrote, through `shard`: frozen and unused parameters, names, ties under a
size policy, dtypes per unit, replicas that agree, per-parameter views and optimizer groups.

Each test reproduces one observation of issue 12 on the model that showed it (PyTorch's own
FSDP test models where one exists) and compares with single-process training and
`fully_shard` on the same data.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from parity_models import WithUnused, nonuniform_req_grad

import fsdp_lab
from fsdp_lab import comm, reference
from fsdp_lab.cluster import intra_op_threads
from fsdp_lab.models import Block, tiny_gpt
from fsdp_lab.sharding import shard
from fsdp_lab.sharding.wrap import MinParams, build_plan

NWM_UNITS = ["module.1", "module.2"]  # the Sequentials PyTorch's own test wraps


def regression_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    """`steps` steps of mean-output loss on this rank's slice of a global batch of 12."""
    rank, world = fsdp_lab.rank(), fsdp_lab.world_size()
    losses = []
    for step in range(steps):
        x = torch.rand(12, 8, generator=torch.Generator().manual_seed(step))
        loss = model(reference.local_slice(x, rank, world)).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _build(factory, how: str, units: list[str]) -> nn.Module:
    model = factory()
    if how == "single":
        return model
    if how == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (fsdp_lab.world_size(),))
        for name in units:
            fully_shard(model.get_submodule(name), mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return shard(model, units=units, strategy=how)


# The trainings run on one thread per rank: several ranks with torch's default thread count
# on a few cores spin against each other, several times slower
# (`fsdp_lab.cluster.rank_threads`); values and bytes are the same.
ONE_THREAD = intra_op_threads(1)


@ONE_THREAD
def _train_and_gather(factory, how, units, optim, steps):
    model = _build(factory, how, units)
    opt = optim(model)
    regression_steps(model, opt, steps)
    return reference.full_parameters(model)


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(_trainable(model), lr=0.1, momentum=0.9)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(_trainable(model), lr=1e-2, weight_decay=0.1)


def _assert_same(got: dict, expected: dict, what: str) -> None:
    assert list(got) == list(expected), what
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=what)


@pytest.mark.parametrize("n", [2, 3])
def test_frozen_parameters_stay_frozen(cluster_of, n):
    """Observation 1: on main every flat parameter required grad and frozen weights moved."""
    before = {k: v.clone() for k, v in nonuniform_req_grad().named_parameters()}
    single = _train_and_gather(nonuniform_req_grad, "single", NWM_UNITS, _sgd, 2)
    runs = {
        how: cluster_of(n).run(_train_and_gather, nonuniform_req_grad, how, NWM_UNITS, _sgd, 2)
        for how in ("full", "grad_op", "none", "fsdp2")
    }
    frozen = [k for k, p in nonuniform_req_grad().named_parameters() if not p.requires_grad]
    assert frozen and len(frozen) < len(before)
    for how, per_rank in runs.items():
        for params in per_rank:
            for name in frozen:
                assert torch.equal(params[name], before[name]), f"{how}: {name} moved"
            _assert_same(params, single, how)
    moved = [k for k in before if not torch.equal(single[k], before[k])]
    assert moved and set(moved).isdisjoint(frozen)  # training did move the trainable ones


@pytest.mark.parametrize("n", [2, 3])
def test_unused_parameters_get_no_gradient_and_no_weight_decay(cluster_of, n):
    """Observation 2: on main an unused parameter got a zero gradient, so AdamW decayed it."""
    before = {k: v.clone() for k, v in WithUnused().named_parameters()}
    single = _train_and_gather(WithUnused, "single", [], _adamw, 5)
    runs = {
        how: cluster_of(n).run(_train_and_gather, WithUnused, how, [], _adamw, 5)
        for how in ("full", "none", "fsdp2")
    }
    for name in ("unused.weight", "unused.bias"):
        assert torch.equal(single[name], before[name])
    for how, per_rank in runs.items():
        for params in per_rank:
            for name in ("unused.weight", "unused.bias"):
                assert torch.equal(params[name], before[name]), f"{how}: {name} decayed"
            _assert_same(params, single, how)


def _grads_after_backward(factory) -> dict[str, bool]:
    model = shard(factory(), strategy="full")
    model(torch.rand(4, 8)).sum().backward()
    return {name: p.grad is not None for name, p in model.named_parameters()}


def test_an_unused_parameter_has_grad_none_on_its_shard(cluster_of):
    for has_grad in cluster_of(2).run(_grads_after_backward, WithUnused):
        assert has_grad["unused.weight"] is False and has_grad["unused.bias"] is False
        assert has_grad["inp.weight"] is True and has_grad["out.bias"] is True


class Named(nn.Module):
    """Submodules whose names contain the wrapper prefixes: `module`, `submodule`."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Sequential(nn.Linear(4, 4))
        self.submodule = nn.Linear(4, 4)


def test_names_keep_module_components_that_are_not_wrappers():
    """Observation 3: `_clean` stripped "module." anywhere (`submodule.weight` -> `subweight`)."""
    names = list(reference.full_parameters(Named()))
    assert names == ["module.0.weight", "module.0.bias", "submodule.weight", "submodule.bias"]


class GPT2Body(nn.Module):
    """Hugging Face's `GPT2Model`: embeddings, blocks, final norm (a module that runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, 16)
        self.wpe = nn.Embedding(32, 16)
        self.h = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.ln_f = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wte(x) + self.wpe(torch.arange(x.shape[-1]))
        for block in self.h:
            h = h + block(h)
        return self.ln_f(h)


class TiedGPT2(nn.Module):
    """Hugging Face GPT-2's layout: the embedding inside `transformer`, the head at the root."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = GPT2Body()
        self.lm_head = nn.Linear(16, 64, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer(x))


@pytest.mark.parametrize("min_params", [100, 272, 600, 1000])
def test_min_params_never_splits_a_tie(min_params):
    """Observation 4: the tied weight was left out of the count, but its parent still became a
    unit (and `build_plan` refused the plan MinParams itself had made)."""
    plan = build_plan(TiedGPT2(), MinParams(min_params))
    unit_of = {r.name: u for u in plan.units for r in plan.params[u]}
    assert "transformer.wte.weight" in unit_of


class MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4).to(torch.bfloat16)
        self.b = nn.Linear(4, 4)


def test_mixed_dtypes_in_one_unit_are_refused_at_wrap_time():
    """Observation 6: accepted, then a dtype error in forward."""
    with pytest.raises(ValueError, match=r"a\.weight.*bfloat16.*b\.weight.*float32|dtype"):
        shard(MixedDtypes())
    shard(MixedDtypes(), units=["a", "b"])  # one dtype per unit: fine


def _replicas_after_wrap() -> dict:
    torch.manual_seed(fsdp_lab.rank())  # every rank builds a different model
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    model[1].running_mean.fill_(float(fsdp_lab.rank()))
    with comm.CommLog() as log:
        shard(model, strategy="none")
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "bytes": log.bytes_by_op().get("broadcast", 0),
    }


def test_strategy_none_broadcasts_rank0_at_wrap_like_ddp(cluster_of):
    """Observation 7: replicas built with different seeds stayed different."""
    r0, r1 = cluster_of(2).run(_replicas_after_wrap)
    assert r0["state"].keys() == r1["state"].keys()
    for name in r0["state"]:
        assert torch.equal(r0["state"][name], r1["state"][name]), name
    # Counted: every parameter and buffer of the model, once (fp32 and the int64 counter).
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    payload = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert r0["bytes"] == payload


def _names_shapes_after(strategy: str) -> list:
    model = shard(nonuniform_req_grad(), units=NWM_UNITS, strategy=strategy)
    return [(n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()]


def test_strategy_none_keeps_the_original_parameters(cluster_of):
    """Observation 10: after shard(strategy="none") named_parameters() gave one flat parameter."""
    original = [
        (n, tuple(p.shape), p.requires_grad) for n, p in nonuniform_req_grad().named_parameters()
    ]
    for got in cluster_of(2).run(_names_shapes_after, "none"):
        assert got == original
    for got in cluster_of(2).run(_names_shapes_after, "full"):  # slices, same names and flags
        assert [(n, rg) for n, _, rg in got] == [(n, rg) for n, _, rg in original]


def _no_decay_groups(model: nn.Module) -> torch.optim.Optimizer:
    """The everyday recipe: no weight decay on biases (chosen by name, not by `p.ndim`)."""
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.5}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
    )


@pytest.mark.parametrize("n", [2, 3])
def test_optimizer_groups_by_parameter_name_match_fully_shard(cluster_of, n):
    """Observation 10: per-parameter groups were impossible on the flat view."""
    units = ["inp", "out"]
    single = _train_and_gather(WithUnused, "single", units, _no_decay_groups, 4)
    for how in ("full", "optimizer", "none", "fsdp2"):
        for params in cluster_of(n).run(
            _train_and_gather, WithUnused, how, units, _no_decay_groups, 4
        ):
            _assert_same(params, single, how)


@ONE_THREAD
def _freeze_after_wrap(how: str) -> dict[str, torch.Tensor]:
    """Two Adam steps, then `blocks.0` frozen (its `requires_grad` set after the wrap), two more."""
    model = reference.wrap(tiny_gpt(), how, (Block,) if how != "single" else ())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    reference.train_steps(model, opt, 2, rank=dist.get_rank(), world=dist.get_world_size())
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith("blocks.0."))
    before = {k: v.detach().clone() for k, v in reference.full_parameters(model).items()}
    reference.train_steps(model, opt, 2, rank=dist.get_rank(), world=dist.get_world_size())
    after = reference.full_parameters(model)
    return {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("n", [1, 2])
def test_a_parameter_frozen_after_the_wrap_stops_moving_as_under_fully_shard(cluster_of, n):
    """Read at each forward, as FSDP2 does: on main `requires_grad` was read once, at the wrap,
    so a block frozen afterwards kept its gradients and Adam kept moving it (by 0.02)."""
    moved = {
        how: cluster_of(n).run(_freeze_after_wrap, how)[0] for how in ("ours:full", "fully_shard")
    }
    for how, steps in moved.items():
        frozen = {k: v.abs().max().item() for k, v in steps.items() if k.startswith("blocks.0.")}
        assert frozen and max(frozen.values()) == 0.0, (how, frozen)
        assert all(v.abs().max() > 0 for k, v in steps.items() if not k.startswith("blocks.0."))
