"""Lab 00 on live ranks: who holds what, bytes equal to the formulas, measured buffers."""

from __future__ import annotations

import pytest

from fsdp_lab.labs import collectives


@pytest.mark.parametrize("n", [1, 3])
def test_collectives_lab_measures_what_the_formulas_say(cluster_of, n):
    numel = 4096
    result = collectives.run(
        collectives.CollectivesConfig(world_size=n, numel=numel, repeats=2), cluster=cluster_of(n)
    )
    assert result["world_size"] == n and result["matches_theory"]
    contents = result["contents"]
    assert contents["broadcast"]["after"] == [[1.0, 1.0]] * n
    assert (
        contents["all_gather_into_tensor"]["after"]
        == [[float(k + 1) for k in range(n) for _ in range(2)]] * n
    )
    total = n * (n + 1) / 2
    assert contents["all_reduce"]["after"] == [[total, total]] * n
    # reduce-scatter: chunk r of sum_k (k+1)*[1..2n] is total*[2r+1, 2r+2].
    assert contents["reduce_scatter_tensor"]["after"] == [
        [total * (2 * r + 1), total * (2 * r + 2)] for r in range(n)
    ]
    # The tracker saw the two buffers: a shard and an n-times-larger gathered tensor.
    buffers = numel * 4 * (1 + n)
    for trace in result["memory_traces"]:
        assert trace["peak_by_category"]["comm_buffers"] == pytest.approx(buffers, rel=0.01)
        assert trace["bytes"]["comm_buffers"][-1] == 0  # and saw them freed
    figures = collectives.figures(result)
    assert {"bytes_vs_theory", "memory_trace", "timeline"} <= set(figures)
