"""PyTorch's own FSDP test models (`torch.testing._internal.common_fsdp`) through `shard`, next to
single-process training, `fully_shard`, FSDP1 and DDP on 2 and 3 ranks (issue 12).

The models, data, optimizers and wrappings are `benchmarks/parity_runs.py`'s — the runs behind
`benchmarks/parity.py`'s table — so a test here and a row there are the same measurement.
"""

from __future__ import annotations

import pytest
import torch
from parity_models import PARITY_MODELS
from parity_runs import COUNTERPARTS, FP32_TOLERANCE, train

# nn.Transformer's note that it skips nested tensors (its layers are not batch-first).
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")

STEPS = 3
Params = dict[str, torch.Tensor]


def _train_each(model: str, systems: list[str], steps: int) -> dict[str, Params]:
    """On every rank: the same model trained under each system in turn."""
    return {system: train(model, system, steps) for system in systems}


def _assert_close(got: Params, expected: Params, what: str) -> None:
    assert sorted(got) == sorted(expected), what  # same names (tied: both)
    for name, value in expected.items():
        torch.testing.assert_close(
            got[name], value, rtol=0, atol=FP32_TOLERANCE, msg=lambda m, n=name: f"{what}: {n}: {m}"
        )


def _assert_trained(model: str, trained: Params) -> None:
    """Control: every parameter that trains moved far beyond the tolerance (a comparison of
    untouched weights would pass whatever the mechanism did)."""
    initial = train(model, "single", 0)
    for name, value in trained.items():
        moved = (value - initial[name]).abs().max().item()
        assert moved > 1000 * FP32_TOLERANCE, f"{name} moved only {moved:.1e}"


@pytest.mark.parametrize("strategy", ["full", "none"])
@pytest.mark.parametrize("model", ["NestedWrappedModule", "TransformerWithSharedParams"])
@pytest.mark.parametrize("n", [2, 3])
def test_common_fsdp_model_matches_single_process_fully_shard_and_fsdp1(
    cluster_of, n, model, strategy
):
    """NestedWrappedModule: nested units (`module.1.0` inside `module.1`).
    TransformerWithSharedParams: a tied embedding/output projection, an nn.Transformer whose
    batch is dim 1. Both with SGD, which (unlike Adam) sees a gradient's scale. Compared with `fully_shard` and FSDP1 in the
    strategy's nearest configuration (COUNTERPARTS: "none" = replicate mesh / NO_SHARD)."""
    ours = f"ours:{strategy}"
    theirs = [COUNTERPARTS[strategy]["fully_shard"], COUNTERPARTS[strategy]["FSDP1"]]
    single = train(model, "single", STEPS)
    _assert_trained(model, single)
    for per_rank in cluster_of(n).run(_train_each, model, [ours, *theirs], STEPS):
        assert list(per_rank[ours]) == list(single)  # original names, in the original order
        _assert_close(per_rank[ours], single, f"{ours} vs single process")
        for system in theirs:
            _assert_close(per_rank[ours], per_rank[system], f"{ours} vs {system}")


def _frozen_and_tied(model: str) -> tuple[list[str], list[tuple[str, str]]]:
    built = PARITY_MODELS[model].build()
    frozen = [n for n, p in built.named_parameters() if not p.requires_grad]
    first: dict[int, str] = {}
    tied = []
    for name, p in built.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied.append((first[id(p)], name))
        first.setdefault(id(p), name)
    return frozen, tied


@pytest.mark.parametrize(
    "model", ["NonUniformReqGradNWM", "TransformerWithSharedParams"], ids=["frozen", "tied"]
)
@pytest.mark.parametrize("n", [2, 3])
def test_strategy_none_matches_ddp_with_frozen_and_tied_parameters(cluster_of, n, model):
    """DDP keeps a frozen parameter frozen even with weight decay on it (its grad stays None)
    and trains a tied weight as one parameter (both uses' gradients summed); so must ours."""
    frozen, tied = _frozen_and_tied(model)
    assert frozen if model == "NonUniformReqGradNWM" else tied  # the case is really there
    initial = train(model, "single", 0)
    single = train(model, "single", STEPS)
    for per_rank in cluster_of(n).run(_train_each, model, ["ours:none", "ddp"], STEPS):
        ours, ddp = per_rank["ours:none"], per_rank["ddp"]
        _assert_close(ours, ddp, "ours:none vs DDP")
        _assert_close(ours, single, "ours:none vs single process")
        for name in frozen:
            assert torch.equal(ours[name], initial[name]), f"ours: frozen {name} moved"
            assert torch.equal(ddp[name], initial[name]), f"DDP: frozen {name} moved"
        for a, b in tied:
            assert torch.equal(ours[a], ours[b]), f"ours: tie {a} = {b} broken"
    trainable = {n: v for n, v in single.items() if n not in frozen}
    _assert_trained(model, trainable)
