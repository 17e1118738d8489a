"""Operators per training step: ours at one rank within 5 % of the plain model, and never more
than `fully_shard` at any world size (`benchmarks/bench_ops.py` counts them on real ranks).

Counted on PyTorch's fake process group, in this process: a rank's operators follow its code
path, which the fake group runs as a real one of that size would (collectives included)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from bench_ops import SMALL, count_ops
from torch.testing._internal.distributed.fake_pg import FakeStore


@pytest.fixture
def fake_world(request):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=request.param)
    yield request.param
    dist.destroy_process_group()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("fake_world", [1], indirect=True)
def test_one_rank_dispatches_within_5_percent_of_the_plain_model(fake_world, precision):
    plain, ours = (count_ops(s, SMALL, precision) for s in ("plain", "ours"))
    extra = {k: n - plain["by_name"].get(k, 0) for k, n in ours["by_name"].items()}
    assert ours["total"] <= 1.05 * plain["total"], (
        f"{precision}: ours {ours['total']} operators per step, the plain model "
        f"{plain['total']}; ours - plain by operator: { {k: n for k, n in extra.items() if n} }"
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("fake_world", [1, 2, 4], indirect=True)
def test_ours_dispatches_no_more_than_fully_shard(fake_world, precision):
    ours, fsdp2 = (count_ops(s, SMALL, precision)["total"] for s in ("ours", "fully_shard"))
    assert ours <= fsdp2, f"{fake_world} rank(s), {precision}: ours {ours}, fully_shard {fsdp2}"


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_each_step_frees_a_unit_before_gathering_the_one_two_blocks_back(fake_world):
    """Fewer operators, not at the price of memory: views kept from an earlier step would keep
    their old autograd nodes, which autograd runs last (newest first), so from step 2 on every
    block stayed gathered until backward's end. Each backward frees blocks.3 before it gathers
    blocks.1, in every step."""
    from fsdp_lab import reference
    from fsdp_lab.models import Block, GPTConfig, TinyGPT
    from fsdp_lab.trace import MemoryTracker

    model = TinyGPT(GPTConfig(64, 16, 32, 4, 4))
    model = reference.wrap(model, "ours:full", (Block,), prefetch=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with MemoryTracker() as mem:
        reference.train_steps(model, optimizer, 3, global_batch=4, world=fake_world)
    labels = [m["label"] for m in mem.trace()["markers"]]
    steps = [labels[labels.index(f"step {s} forward done") :] for s in range(3)]
    for step, after_forward in enumerate(steps):
        order = [x for x in after_forward if x in ("free blocks.3", "all-gather blocks.1")]
        assert order[:2] == ["free blocks.3", "all-gather blocks.1"], (step, after_forward[:12])
