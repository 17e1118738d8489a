"""Operators per training step: ours at one rank within 5 % of the plain model, and never more
than `fully_shard` at any world size (`benchmarks/bench_ops.py` counts them on real ranks).

Counted on PyTorch's fake process group, in this process: a rank's operators follow its code
path, which the fake group runs as a real one of that size would (collectives included)."""

from __future__ import annotations

import pytest
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
