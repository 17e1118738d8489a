"""A course's own test suite for students' DDP / FSDP / ZeRO-1, wired to fsdp_lab and, beside it,
to PyTorch (issue 28): eight checks, each run on 2 live gloo ranks against one process.

The glue is what a student's harness would write — which call makes DDP, FSDP, a full state
dict, a ZeRO-1 optimizer — and nothing of the mechanism. The FSDP of the suite shards every
Linear and Embedding and expects every other parameter (the norms) whole on every rank with
the same gradient: fsdp_lab's glue asks for that with a policy on the root unit (`UnitPolicy(
strategy="replicate")`); PyTorch's keeps its norms as DTensors, which the glue reads whole.

The eighth check asks DDP for a result bit-equal to one process: averaging two half-batch
gradients rounds differently from one full-batch gradient, so it fails for both systems — by
the same amount, since our "none" is DDP's arithmetic bucket for bucket.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab.cluster import intra_op_threads

VOCAB, DIM, STEPS, BATCH = 64, 32, 3, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.fc2(torch.relu(self.fc1(self.norm1(x))))
        return self.norm2(x)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


SHARDED = (nn.Linear, nn.Embedding)  # the suite's FSDP units; everything else stays whole


def _is_sharded(name: str, model: nn.Module) -> bool:
    return isinstance(model.get_submodule(name.rpartition(".")[0]), SHARDED)


# -- the glue: one function per thing the suite asks of a system ----------------------------------


def _ours_ddp(model):
    from fsdp_lab.sharding import shard

    return shard(model, strategy="none")


def _ours_fsdp(model, mixed_precision=None):
    from fsdp_lab.sharding import MixedPrecision, UnitPolicy, shard

    mp = MixedPrecision(torch.bfloat16, torch.float32) if mixed_precision else None
    root = UnitPolicy(strategy="replicate")
    return shard(
        model, units=set(SHARDED), strategy="full", mixed_precision=mp, policies={"": root}
    )


def _ours_state_dict(model):
    from fsdp_lab.sharding import full_state_dict

    return full_state_dict(model, rank0_only=False)


def _ours_zero1(model, params):
    from fsdp_lab.sharding import ShardedOptimizer

    return ShardedOptimizer(params, torch.optim.Adam, lr=1e-2)


def _torch_ddp(model):
    return nn.parallel.DistributedDataParallel(model)


def _torch_fsdp(model, mixed_precision=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = (
        {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)}
        if mixed_precision
        else {}
    )
    for module in model.modules():
        if isinstance(module, SHARDED):
            fully_shard(module, **kw)
    return fully_shard(model, **kw)


def _torch_state_dict(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    module = getattr(model, "module", model)
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))


def _torch_zero1(model, params):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=1e-2)


GLUE = {
    "fsdp_lab": {
        "ddp": _ours_ddp,
        "fsdp": _ours_fsdp,
        "state": _ours_state_dict,
        "zero1": _ours_zero1,
    },
    "pytorch": {
        "ddp": _torch_ddp,
        "fsdp": _torch_fsdp,
        "state": _torch_state_dict,
        "zero1": _torch_zero1,
    },
}


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient as the suite reads it: PyTorch's DTensors made whole."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# -- what runs on the ranks ---------------------------------------------------------------------


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, 9), generator=torch.Generator().manual_seed(step))


def _train(
    system: str | None,
    wrap: str,
    steps: int = STEPS,
    optimizer: str = "sgd",
    keep_grads: bool = False,
    micro_batches: int = 1,
    **kw,
):
    """Train TinyLM (seed 0) `steps` steps; None = one process on the whole batch, or, with
    `micro_batches` = N, one process summing the gradients of the N ranks' slices, each loss
    divided by N. Returns the model and, per step, the loss."""
    torch.manual_seed(0)
    model = TinyLM()
    rank, world = (dist.get_rank(), dist.get_world_size()) if system else (0, 1)
    if system:
        model = GLUE[system][wrap](model, **kw)
    if optimizer == "zero1" and system:
        opt = GLUE[system]["zero1"](model, model.parameters())
    elif optimizer in ("zero1", "adam"):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        for micro in range(micro_batches):
            n, r = (micro_batches, micro) if micro_batches > 1 else (world, rank)
            tokens = _batch(step)[r * BATCH // n : (r + 1) * BATCH // n]
            logits = model(tokens[:, :-1]).float()
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            (loss / micro_batches).backward()
        if step < steps - 1 or not keep_grads:  # keep_grads: the last step's gradients stay
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def _params(model) -> dict[str, torch.Tensor]:
    module = getattr(model, "module", model)
    return {n: _whole(p).detach().clone() for n, p in module.named_parameters()}


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of `t`, by a raw all_gather — the suite's own way to compare ranks."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def check_ddp_matches_one_process(system):
    model, _ = _train(system, "ddp")
    return _params(model)


def check_ddp_grads_equal_on_ranks(system):
    model, _ = _train(system, "ddp", keep_grads=True)
    return all(
        all(torch.equal(g, p.grad) for g in _gathered(p.grad))
        for p in getattr(model, "module", model).parameters()
    )


def check_fsdp_matches_one_process(system):
    model, _ = _train(system, "fsdp")
    return GLUE[system]["state"](model)


def check_fsdp_other_params_whole_with_equal_grads(system):
    model, _ = _train(system, "fsdp", keep_grads=True)
    full = dict(TinyLM().named_parameters())
    report = {}
    for name, p in model.named_parameters():
        if _is_sharded(name, model):
            continue
        value, grad = _whole(p), _whole(p.grad)
        same_shape = value.shape == full[name].shape
        report[name] = same_shape and all(torch.equal(g, grad) for g in _gathered(grad))
    return report


def check_fsdp_mixed_precision(system):
    model, losses = _train(system, "fsdp", mixed_precision=True)
    state = GLUE[system]["state"](model)
    return losses, state


def check_full_state_dict_loads_into_plain_model(system):
    model, _ = _train(system, "fsdp")
    state = GLUE[system]["state"](model)
    plain = TinyLM()
    plain.load_state_dict(state, strict=True)
    tokens = _batch(99)[:, :-1]
    return plain(tokens).detach(), _whole(model(tokens)).detach()


def check_zero1_matches_one_process(system):
    model, _ = _train(system, "ddp", optimizer="zero1")
    return _params(model)


# -- the tests ----------------------------------------------------------------------------------

SYSTEMS = ["fsdp_lab", "pytorch"]


def _close(got, expected, atol=1e-6):
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=atol, msg=name)


@pytest.fixture(scope="module")
def one_process():
    sgd, _ = _train(None, "ddp")
    adam, _ = _train(None, "ddp", optimizer="adam")
    _, losses = _train(None, "ddp")
    torch.manual_seed(0)
    start = {n: p.detach().clone() for n, p in TinyLM().named_parameters()}
    return {"sgd": _params(sgd), "adam": _params(adam), "losses": losses, "start": start}


def _moved(params, start):
    """Control: training moved every parameter far beyond the tolerance."""
    return min((params[n] - start[n]).abs().max().item() for n in start)


@pytest.mark.parametrize("system", SYSTEMS)
def test_1_ddp_matches_one_process(cluster_of, one_process, system):
    for got in cluster_of(2).run(check_ddp_matches_one_process, system):
        _close(got, one_process["sgd"])
    assert _moved(one_process["sgd"], one_process["start"]) > 1e-4


@pytest.mark.parametrize("system", SYSTEMS)
def test_2_ddp_gradients_equal_on_every_rank(cluster_of, system):
    assert all(cluster_of(2).run(check_ddp_grads_equal_on_ranks, system))


@pytest.mark.parametrize("system", SYSTEMS)
def test_3_fsdp_matches_one_process(cluster_of, one_process, system):
    for got in cluster_of(2).run(check_fsdp_matches_one_process, system):
        _close(got, one_process["sgd"])


@pytest.mark.parametrize("system", SYSTEMS)
def test_4_fsdp_keeps_the_other_parameters_whole_with_equal_gradients(cluster_of, system):
    for report in cluster_of(2).run(check_fsdp_other_params_whole_with_equal_grads, system):
        assert len(report) == 10  # 2 blocks x 2 norms x (weight, bias) + the final norm
        assert all(report.values()), report


@pytest.mark.parametrize("system", SYSTEMS)
def test_5_fsdp_mixed_precision_trains_like_fp32(cluster_of, one_process, system):
    per_rank = cluster_of(2).run(check_fsdp_mixed_precision, system)
    for _, state in per_rank:
        assert state["head.weight"].dtype == torch.float32  # fp32 master weights
    # The global batch's loss is the mean of the two half-batches' losses; bf16 compute keeps it
    # within bf16's resolution (2^-8) of fp32 training.
    mean = [sum(step) / len(step) for step in zip(*(losses for losses, _ in per_rank), strict=True)]
    torch.testing.assert_close(mean, one_process["losses"], rtol=1e-2, atol=0)


@pytest.mark.parametrize("system", SYSTEMS)
def test_6_full_state_dict_loads_into_a_plain_model(cluster_of, system):
    for plain_out, sharded_out in cluster_of(2).run(
        check_full_state_dict_loads_into_plain_model, system
    ):
        torch.testing.assert_close(plain_out, sharded_out, rtol=0, atol=1e-5)


@pytest.mark.parametrize("system", SYSTEMS)
def test_7_zero1_matches_one_process(cluster_of, one_process, system):
    for got in cluster_of(2).run(check_zero1_matches_one_process, system):
        _close(got, one_process["adam"], atol=1e-5)


@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.xfail(strict=True, reason="two half-batch means round unlike one full-batch mean")
def test_8_ddp_equals_one_process_bit_for_bit(cluster_of, one_process, system):
    for got in cluster_of(2).run(check_ddp_matches_one_process, system):
        for name, value in one_process["sgd"].items():
            assert torch.equal(got[name], value), name


def _one_thread(wrap, system):
    with intra_op_threads(1):
        model, _ = _train(system, wrap)
        return {n: _whole(v) for n, v in GLUE[system]["state"](model).items()}


@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_8s_reference_that_holds_one_process_summing_the_ranks_micro_batches(
    cluster_of, one_process, system, wrap
):
    """Issue 37: why check 8 fails, measured. Dividing before or after the sum, or adding the
    ranks' gradients in another order, changes nothing on 2 ranks (a + b = b + a; halving is
    exact). What differs is inside each rank's kernels: a matmul or a sum over the whole batch
    adds its rows in another order than two half-batch ones added after. One process that
    sums the two halves' gradients, as the ranks do, is matched bit for bit — by DDP and by
    ZeRO-3 (the suite's FSDP), ours and PyTorch's alike — while one process on the whole batch
    is not (the control)."""
    with intra_op_threads(1):  # as on the ranks: a kernel's blocking may follow its threads
        halves = _params(_train(None, "ddp", micro_batches=2)[0])
    for got in cluster_of(2).run(_one_thread, wrap, system):
        for name, value in halves.items():
            assert torch.equal(got[name], value), name
        assert any(not torch.equal(got[n], one_process["sgd"][n]) for n in got)


def test_8_fails_by_the_same_difference_for_both_systems(cluster_of, one_process):
    """The eighth check's failure is arithmetic, not ours: fsdp_lab's DDP and PyTorch's are
    bit-equal to each other, so they miss one process by exactly the same amounts."""
    ours = cluster_of(2).run(check_ddp_matches_one_process, "fsdp_lab")[0]
    theirs = cluster_of(2).run(check_ddp_matches_one_process, "pytorch")[0]
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    worst = max((ours[n] - one_process["sgd"][n]).abs().max().item() for n in ours)
    assert 0 < worst < 1e-6
