"""ShardedOptimizer (ZeRO-1 as an optimizer): trains like PyTorch's ZeroRedundancyOptimizer
and like one process; each parameter's state on one rank, balanced; every step broadcasts
exactly the parameters' bytes, and without that broadcast the replicas would drift apart."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdp_lab
from fsdp_lab import comm
from fsdp_lab.cluster import intra_op_threads
from fsdp_lab.sharding import ShardedOptimizer
from fsdp_lab.sharding.sharded_optimizer import greedy_assignment

STEPS = 4
GLOBAL_BATCH = 12  # divides over 1, 2, 3 and 4 ranks
LR = 1e-2


class Net(nn.Module):
    """Parameters of six sizes (96, 80, 16, 16, 16, 5), norms and biases among them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 6) -> (B, 5)
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def _groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict[str, Any]]:
    """The everyday recipe: weight decay on matrices, none on norms and biases."""
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)


def _train(
    model: nn.Module, opt: Any, steps: int, rank: int, world: int, first: int = 0, sched: Any = None
) -> None:
    """`steps` steps from batch `first` on, this rank's contiguous slice of each global batch."""
    per = GLOBAL_BATCH // world
    for step in range(first, first + steps):
        x, y = _batch(step)
        loss = F.mse_loss(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k.removeprefix("module."): v.detach().clone() for k, v in model.named_parameters()}


def _ddp(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


# -- parity -------------------------------------------------------------------------------------


# The trainings run on one thread per rank: several ranks with torch's default thread count
# on a few cores spin against each other, several times slower
# (`fsdp_lab.cluster.rank_threads`); values and bytes are the same.
ONE_THREAD = intra_op_threads(1)


@ONE_THREAD
def _three_ways(optimizer_class: type, steps: int) -> dict[str, Any]:
    """On every rank, DDP for the gradients and three optimizers: ours, PyTorch's, replicated."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    r, n = fsdp_lab.rank(), fsdp_lab.world_size()
    out: dict[str, Any] = {}
    for how in ("ours", "zero_redundancy", "replicated"):
        model = Net()
        groups = _groups(model)
        if how == "ours":
            opt = ShardedOptimizer(groups, optimizer_class, lr=LR)
        elif how == "zero_redundancy":
            opt = ZeroRedundancyOptimizer(groups, optimizer_class=optimizer_class, lr=LR)
        else:
            opt = optimizer_class(groups, lr=LR)
        _train(_ddp(model), opt, steps, r, n)
        out[how] = _params(model)
        if how == "ours":
            names = {p: k for k, p in model.named_parameters()}
            out["state_on_this_rank"] = sorted(names[p] for p, s in opt.state.items() if s)
            out["owner"] = {names[p]: opt.owner_of(p) for p in names}
            out["state_bytes"] = sum(
                t.numel() * t.element_size()
                for s in opt.state.values()
                for t in s.values()
                if torch.is_tensor(t)
            )
        if how == "zero_redundancy":  # PyTorch's assignment (a private table, read for the test)
            names = {p: k for k, p in model.named_parameters()}
            out["zero_redundancy_owner"] = {names[p]: r_ for p, r_ in opt._param_to_rank.items()}
    return out


def _single_process(optimizer_class: type, steps: int) -> dict[str, torch.Tensor]:
    model = Net()
    _train(model, optimizer_class(_groups(model), lr=LR), steps, 0, 1)
    return _params(model)


@pytest.fixture(scope="module")
def trained(cluster_of):
    """(n, optimizer class) -> every rank's results, computed once for the tests below."""
    cache: dict[tuple[int, type], list[dict[str, Any]]] = {}

    def get(n: int, optimizer_class: type) -> list[dict[str, Any]]:
        if (n, optimizer_class) not in cache:
            cache[n, optimizer_class] = cluster_of(n).run(_three_ways, optimizer_class, STEPS)
        return cache[n, optimizer_class]

    return get


@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("n", [2, 3])
def test_bitwise_equal_to_zero_redundancy_optimizer_and_a_replicated_optimizer(
    trained, n, optimizer_class
):
    # Bitwise: every variant sees the same DDP-averaged gradients, and each parameter is
    # stepped by the same per-parameter arithmetic on whichever rank owns it, then copied.
    initial = _params(Net())
    for r, res in enumerate(trained(n, optimizer_class)):
        for name, expected in res["replicated"].items():
            assert torch.equal(res["ours"][name], expected), f"{name} rank {r} vs replicated"
            assert torch.equal(res["ours"][name], res["zero_redundancy"][name]), name
            assert not torch.equal(expected, initial[name]), f"{name} never moved"


@pytest.mark.parametrize("n", [2, 3])
def test_matches_single_process_training_within_reduction_order(trained, n):
    # Not bitwise: one process takes the mean over 12 samples at once, DDP averages the ranks'
    # means with an all-reduce; a different order of fp32 sums changes last bits (~1e-7
    # relative), which four Adam steps of lr 1e-2 turn into differences of ~3e-8 (2 ranks) and
    # ~6e-8 (3 ranks), measured when this was written: 1e-6 leaves room for other CPUs.
    expected = _single_process(torch.optim.AdamW, STEPS)
    for res in trained(n, torch.optim.AdamW):
        for name, value in expected.items():
            torch.testing.assert_close(res["ours"][name], value, rtol=0, atol=1e-6)
        # Training moved every parameter by far more than the tolerance.
        assert min((expected[k] - v).abs().max() for k, v in _params(Net()).items()) > 1e-3


@pytest.mark.parametrize("n", [2, 3])
def test_state_of_each_parameter_on_exactly_one_rank_balanced_as_pytorch(trained, n):
    per_rank = trained(n, torch.optim.AdamW)
    names = [k for k, _ in Net().named_parameters()]
    holders = {
        k: [r for r, res in enumerate(per_rank) if k in res["state_on_this_rank"]] for k in names
    }
    owner = per_rank[0]["owner"]
    assert holders == {k: [owner[k]] for k in names}  # one rank each: its owner
    assert all(res["owner"] == owner for res in per_rank)  # every rank agrees
    assert owner == per_rank[0]["zero_redundancy_owner"]  # PyTorch's sorted greedy, exactly
    numel = dict((k, p.numel()) for k, p in Net().named_parameters())
    loads = [sum(numel[k] for k in names if owner[k] == r) for r in range(n)]
    # Sorted greedy keeps the most and least loaded ranks within one parameter of each other.
    assert max(loads) - min(loads) <= max(numel.values())
    for r, res in enumerate(per_rank):  # AdamW: two fp32 moments + a 4-byte step per parameter
        owned = [k for k in names if owner[k] == r]
        assert res["state_bytes"] == 8 * loads[r] + 4 * len(owned)


def test_greedy_assignment_largest_first_to_the_least_loaded_rank():
    sizes = [5, 96, 16, 80, 16]
    loads = [0, 0]
    owners = greedy_assignment([torch.empty(s) for s in sizes], loads)
    # 96 -> 0; 80 -> 1; 16 -> 1 (80 < 96); 16 -> 0 (tie 96/96: the lower rank); 5 -> 1.
    assert owners == [1, 0, 1, 1, 0] and loads == [112, 101]
    # A later group continues from these loads.
    assert greedy_assignment([torch.empty(20)], loads) == [1] and loads == [112, 121]


# -- the broadcast --------------------------------------------------------------------------------


def _bytes_of_one_step(freeze: bool) -> dict[str, Any]:
    model = Net()
    if freeze:
        model.norm.requires_grad_(False)
    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=LR)
    ddp = _ddp(model)
    _train(ddp, opt, 1, fsdp_lab.rank(), fsdp_lab.world_size())  # the state exists now
    x, y = _batch(1)
    F.mse_loss(ddp(x), y).backward()
    with comm.CommLog() as log:
        opt.step()
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {
        "bytes": log.bytes_by_op(),
        "calls": log.calls_by_op(),
        "trainable_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "trainable_count": len(trainable),
        "norm_weight": model.norm.weight.detach().clone(),
    }


@pytest.mark.parametrize("n", [2, 3])
def test_step_broadcasts_exactly_the_trainable_parameters_bytes(cluster_of, n):
    for freeze in (False, True):
        for res in cluster_of(n).run(_bytes_of_one_step, freeze):
            # comm counts a broadcast's bytes on every rank (its own sends, the rest received):
            # one step moves each trainable parameter once, Σ numel × 4 B, one call each.
            assert res["bytes"] == {"broadcast": res["trainable_bytes"]}
            assert res["calls"] == {"broadcast": res["trainable_count"]}
            if freeze:  # a frozen parameter is neither stepped nor sent
                assert res["trainable_count"] == 4
                assert torch.equal(res["norm_weight"], torch.ones(16))
            else:
                assert res["trainable_bytes"] == 4 * sum(p.numel() for p in Net().parameters())


def _with_and_without_broadcast() -> dict[str, Any]:
    """One step with the local step alone (no broadcast), one with the full step()."""
    out = {}
    for how in ("local step only", "step"):
        model = Net()
        opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=LR)
        ddp = _ddp(model)
        x, y = _batch(0)
        F.mse_loss(ddp(x), y).backward()
        opt.optim.step() if how == "local step only" else opt.step()
        out[how] = _params(model)
    return out


def test_without_the_broadcast_the_replicas_diverge(cluster_of):
    per_rank = cluster_of(2).run(_with_and_without_broadcast)
    initial = _params(Net())
    for how in ("local step only", "step"):
        differ = [k for k in initial if not torch.equal(per_rank[0][how][k], per_rank[1][how][k])]
        if how == "local step only":  # each rank moved only what it owns: every parameter
            assert sorted(differ) == sorted(initial)  # differs between the two replicas
        else:
            assert differ == []  # the owners' broadcasts brought every replica to the same
            assert all(not torch.equal(per_rank[1]["step"][k], initial[k]) for k in initial)


# -- param groups, schedulers, checkpoints --------------------------------------------------------


def _groups_scheduler_and_checkpoint() -> dict[str, Any]:
    r, n = fsdp_lab.rank(), fsdp_lab.world_size()

    def build(cls: type, added_late: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = Net()
        decay, no_decay = _groups(model)
        if cls is ShardedOptimizer:
            opt = ShardedOptimizer([decay], torch.optim.AdamW, lr=LR)
        else:
            opt = torch.optim.AdamW([decay], lr=LR)
        if added_late:
            opt.add_param_group(no_decay)
        return model, opt

    out: dict[str, Any] = {}
    for cls in (ShardedOptimizer, torch.optim.AdamW):
        model, opt = build(cls, added_late=True)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        _train(_ddp(model), opt, STEPS, r, n, sched=sched)
        out[cls.__name__] = {"params": _params(model), "state_dict": opt.state_dict()}
    # Save after 2 steps, load into a fresh optimizer, 2 more steps: as if never interrupted.
    model, opt = build(ShardedOptimizer, added_late=True)
    _train(_ddp(model), opt, 2, r, n)
    buffer = io.BytesIO()  # through bytes, as a checkpoint file: state_dict() holds references
    torch.save(opt.state_dict(), buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()))
    resumed_model, resumed = build(ShardedOptimizer, added_late=True)
    resumed_model.load_state_dict(model.state_dict())
    resumed.load_state_dict(saved)
    _train(_ddp(resumed_model), resumed, 2, r, n, first=2)
    # A fresh DDP for the uninterrupted run too: DDP regroups its buckets after its first step,
    # and on 3 ranks a gradient's sum then runs in another order (last bits differ).
    _train(_ddp(model), opt, 2, r, n, first=2)
    out["uninterrupted"], out["resumed"] = _params(model), _params(resumed_model)
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_param_groups_schedulers_and_state_dict_behave_as_a_plain_optimizer(cluster_of, n):
    for res in cluster_of(n).run(_groups_scheduler_and_checkpoint):
        ours, plain = res["ShardedOptimizer"], res["AdamW"]
        for k, v in plain["params"].items():  # a group added late, an lr halved every step
            assert torch.equal(ours["params"][k], v), k
        # state_dict() consolidated on call: the plain optimizer's dict, every rank alike.
        assert ours["state_dict"]["param_groups"] == plain["state_dict"]["param_groups"]
        assert (
            set(ours["state_dict"]["state"]) == set(plain["state_dict"]["state"]) == set(range(6))
        )
        for i, state in plain["state_dict"]["state"].items():
            for key, value in state.items():
                assert torch.equal(ours["state_dict"]["state"][i][key], value), (i, key)
        for k, v in res["uninterrupted"].items():
            assert torch.equal(res["resumed"][k], v), k


def _save_after_two_steps() -> dict[str, Any]:
    model = Net()
    opt = ShardedOptimizer(_groups(model), torch.optim.AdamW, lr=LR)
    _train(_ddp(model), opt, 2, fsdp_lab.rank(), fsdp_lab.world_size())
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _resume(saved: dict[str, Any]) -> dict[str, Any]:
    """Two more steps from `saved`, with ShardedOptimizer and with the plain AdamW."""
    out = {}
    for cls in (ShardedOptimizer, torch.optim.AdamW):
        model = Net()
        model.load_state_dict(saved["model"])
        groups = _groups(model)
        if cls is ShardedOptimizer:
            opt = ShardedOptimizer(groups, torch.optim.AdamW, lr=LR)
        else:
            opt = torch.optim.AdamW(groups, lr=LR)
        # A copy each: load_state_dict keeps the given tensors (as torch's optimizers do), and
        # training updates them in place.
        opt.load_state_dict(copy.deepcopy(saved["optimizer"]))
        _train(_ddp(model), opt, 2, fsdp_lab.rank(), fsdp_lab.world_size(), first=2)
        out[cls.__name__] = _params(model)
    return out


def test_a_state_dict_saved_on_3_ranks_resumes_on_2_as_the_plain_optimizer(cluster_of):
    saved = cluster_of(3).run(_save_after_two_steps)[0]  # the same dict on every rank
    assert set(saved["optimizer"]["state"]) == set(range(6))
    for res in cluster_of(2).run(_resume, saved):
        for k, v in res["AdamW"].items():
            assert torch.equal(res["ShardedOptimizer"][k], v), k


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, optimizer_class, message",
    [
        (lambda: Net().parameters(), torch.optim.SGD(Net().parameters(), lr=1), "instance"),
        (lambda: Net().parameters(), "adam", "expected a torch.optim.Optimizer subclass"),
        (lambda: [], torch.optim.Adam, r"expected at least one parameter"),
        (lambda: [{"params": []}], torch.optim.Adam, r"expected at least one parameter"),
        (lambda: torch.zeros(3, requires_grad=True), torch.optim.Adam, "one tensor"),
    ],
)
def test_bad_input_is_a_clear_error(params, optimizer_class, message):
    with pytest.raises((TypeError, ValueError), match=message):
        ShardedOptimizer(params(), optimizer_class, lr=1e-3)


def test_outside_the_ranks_the_error_says_where_to_build_it():
    with pytest.raises(RuntimeError, match=r"cluster.run\(fn\)"):
        ShardedOptimizer(Net().parameters(), torch.optim.Adam, lr=1e-3)


def _several_devices() -> str:
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, device="meta"))]
    try:
        ShardedOptimizer(params, torch.optim.Adam, lr=1e-3)
    except ValueError as e:
        return str(e)
    return "no error"


def test_parameters_on_several_devices_are_refused(cluster_of):
    message = cluster_of(2).run(_several_devices)[0]
    assert "several devices (cpu: parameters [0]; meta: parameters [1])" in message
    assert "model.to(device)" in message


def _group_from_a_generator() -> dict[str, Any]:
    model = Net()
    opt = ShardedOptimizer([{"params": model.parameters(), "lr": 0.5}], torch.optim.SGD, lr=LR)
    return {
        "in_group": len(opt.param_groups[0]["params"]),
        "owned": [len(ps) for ps in opt.params_per_rank],
        "lr": opt.optim.param_groups[0]["lr"],
    }


def test_a_param_group_given_as_a_generator_keeps_its_parameters(cluster_of):
    for res in cluster_of(2).run(_group_from_a_generator):
        assert res == {"in_group": 6, "owned": [3, 3], "lr": 0.5}
