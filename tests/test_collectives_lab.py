"""Lab 00 on live ranks: who holds what, bytes equal to the formulas, measured buffers."""

from __future__ import annotations

import pytest

from fsdp_lab.collectives import lab as collectives


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


def test_the_map_of_parallelisms_measures_what_is_built_and_marks_the_rest_theory(cluster_of):
    from fsdp_lab.collectives.lab import parallelism

    result = parallelism.run(cluster_of(2))
    rows = {r["strategy"]: r for r in result["rows"]}
    for name in ("data (DDP)", "data, sharded (FSDP)", "pipeline (GPipe)"):
        assert rows[name]["measured_bytes"] > 0
        assert rows[name]["measured_bytes"] == pytest.approx(rows[name]["formula_bytes"], rel=1e-12)
    # FSDP sends more than DDP (one more all-gather of all but the root), the pipeline far less.
    assert rows["data, sharded (FSDP)"]["measured_bytes"] > rows["data (DDP)"]["measured_bytes"]
    assert rows["pipeline (GPipe)"]["measured_bytes"] < rows["data (DDP)"]["measured_bytes"] / 10
    assert (
        rows["hybrid (HSDP)"]["measured_bytes"] is None and "N = 2" in rows["hybrid (HSDP)"]["note"]
    )
    for name in ("tensor (Megatron)", "context (ring attention)"):
        assert rows[name]["measured_bytes"] is None and "theory only" in rows[name]["note"]
        assert rows[name]["formula_bytes"] > 0
    text = parallelism.table_of(result)
    assert text.count("theory only") == 2 and "N = 2 ranks" in text


def test_the_all_reduce_sentence_compares_bytes_per_byte_of_input():
    from fsdp_lab.collectives.lab import report

    # 4 ranks, a 1 KiB shard: reduce-scatter of the 4 KiB vector moves 3 KiB, all-reduce of the
    # shard 1.5 KiB — a shorter bar, but 2x the bytes per byte reduced.
    result = {
        "world_size": 4,
        "shard_bytes": 1024,
        "comm_bytes_per_rank": [{"reduce_scatter_tensor": 3072.0, "all_reduce": 1536.0}],
    }
    text = report.all_reduce_sentence(result)
    assert "**2×** the reduce-scatter's bytes" in text and "its bar is shorter" in text
    # 2 ranks: the two bars are equal (1 KiB each); the sentence follows the numbers.
    result = {
        "world_size": 2,
        "shard_bytes": 1024,
        "comm_bytes_per_rank": [{"reduce_scatter_tensor": 1024.0, "all_reduce": 1024.0}],
    }
    assert "its bar is not shorter" in report.all_reduce_sentence(result)


def test_the_waiting_sentence_splits_the_longest_span_from_the_timelines():
    from fsdp_lab.collectives.lab import report

    def tl(rank, origin, start, end):
        span = {"kind": "comm", "name": "broadcast", "start": start, "end": end, "group": "w"}
        return {"rank": rank, "origin": origin, "host": "h", "spans": [span]}

    early = {"timelines": [tl(0, 0.0, 0.0, 2.0), tl(1, 1.5, 0.0, 0.5)]}  # rank 0 waits 1.5 s
    text = report.waiting_sentence(early)
    assert "**2000.0 ms inside `broadcast` on rank 0**, was 1500.0 ms of waiting" in text
    assert "mostly waiting" in text
    together = {"timelines": [tl(0, 0.0, 0.0, 2.0), tl(1, 0.25, 0.0, 1.75)]}
    assert "mostly moving bytes" in report.waiting_sentence(together)
