"""fsdp_lab.comm: the collectives give the right values and count exactly the ring bytes."""

from __future__ import annotations

import pytest
import torch

from fsdp_lab import comm, device, rank, world_size
from fsdp_lab.trace import Timeline, compute_span


def _exercise_every_op() -> dict:
    r, n = rank(), world_size()
    with comm.CommLog() as log, Timeline(rank=r) as timeline:
        shard = torch.arange(3, dtype=torch.float32, device=device()) + 10 * r  # 12 bytes
        full = torch.empty(3 * n)
        comm.all_gather_into_tensor(full, shard)

        mine = torch.empty(3)
        comm.reduce_scatter_tensor(mine, full)  # `full` is equal everywhere: chunk r times n

        x = torch.full((5,), float(r + 1), dtype=torch.float64)  # 40 bytes
        comm.all_reduce(x)

        b = torch.full((4,), float(r))  # 16 bytes
        comm.broadcast(b, src=n - 1)

        late = torch.empty(3 * n)
        work = comm.all_gather_into_tensor(late, shard, async_op=True)
        open_records = len(log.records)  # the async record is closed by wait(), not before
        with compute_span("overlapped work"):
            torch.mm(torch.ones(8, 8), torch.ones(8, 8))
        with compute_span("wait"):
            work.wait()

        got = torch.full((2,), -1.0)
        if n > 1:  # a ring: everyone sends its rank right and receives from the left
            sent = comm.send(torch.full((2,), float(r)), dst=(r + 1) % n, async_op=True)
            received = comm.recv(got, src=(r - 1) % n, async_op=True)
            sent.wait()
            received.wait()
    return {
        "full": full.tolist(),
        "mine": mine.tolist(),
        "x": x.tolist(),
        "b": b.tolist(),
        "late": late.tolist(),
        "got": got.tolist(),
        "open_records": open_records,
        "log": log.to_dict(),
        "timeline": timeline.to_dict(),
    }


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_values_and_bytes_of_every_collective(cluster_of, n):
    results = cluster_of(n).run(_exercise_every_op)
    gathered = [float(v + 10 * k) for k in range(n) for v in range(3)]
    for r, res in enumerate(results):
        assert res["full"] == gathered and res["late"] == gathered
        assert res["mine"] == [n * (v + 10 * r) for v in range(3)]
        assert res["x"] == [n * (n + 1) / 2] * 5
        assert res["b"] == [float(n - 1)] * 4
        if n > 1:
            assert res["got"] == [float((r - 1) % n)] * 2

        ops = [rec["op"] for rec in res["log"]["records"]]
        expected_ops = [
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "all_reduce",
            "broadcast",
        ]
        expected_ops += ["all_gather_into_tensor"] + (["send", "recv"] if n > 1 else [])
        assert ops == expected_ops
        # Ring-algorithm bytes per rank, written out from `fsdp_lab.theory`'s formulas.
        moved = [rec["bytes"] for rec in res["log"]["records"]]
        expected = [12 * (n - 1), 12 * (n - 1), 2 * (n - 1) / n * 40, 16 if n > 1 else 0]
        expected += [12 * (n - 1)] + ([8, 8] if n > 1 else [])
        assert moved == pytest.approx(expected, abs=0)
        assert all(
            rec["group"] == "ranks " + ",".join(map(str, range(n))) for rec in res["log"]["records"]
        )
        assert [rec["async_op"] for rec in res["log"]["records"]][3:5] == [False, True]
        assert res["open_records"] == 4

        spans = res["timeline"]["spans"]
        comm_spans = [s for s in spans if s["kind"] == "comm"]
        assert [s["name"] for s in comm_spans] == ops
        assert [s["name"] for s in spans if s["kind"] == "compute"] == ["overlapped work", "wait"]
        assert all(s["end"] >= s["start"] for s in spans)
        # The async all-gather's span starts before the compute issued while it was in flight
        # and ends when its bytes arrived (the backend's future): by the end of wait() at the
        # latest, whatever the compute did meanwhile.
        late_span = comm_spans[4]
        compute, wait = (s for s in spans if s["kind"] == "compute")
        assert late_span["start"] <= compute["start"] and late_span["end"] <= wait["end"]


def test_without_a_log_nothing_is_recorded_and_values_are_right(cluster_of):
    def plain():
        x = torch.ones(2)
        work = comm.all_reduce(x, async_op=True)
        work.wait()
        return x.tolist()

    assert cluster_of(2).run(plain) == [[2.0, 2.0], [2.0, 2.0]]


def test_bus_bytes_rejects_unknown_ops():
    with pytest.raises(ValueError, match="unknown collective 'all_to_all'"):
        comm.bus_bytes("all_to_all", 8, 2)


def _timeline(rank: int, origin: float, spans: list, host: str = "h") -> dict:
    keys = ("kind", "name", "start", "end", "group")
    return {
        "rank": rank,
        "origin": origin,
        "host": host,
        "spans": [dict(zip(keys, s, strict=True)) for s in spans],
    }


def test_the_part_of_a_collective_before_the_last_rank_entered_is_waiting():
    from fsdp_lab.trace.timeline import time_shares, waiting_times

    # rank 0 enters the broadcast at 1.0 (its origin 0), rank 1 only at 3.0 (origin 2, start
    # 1.0): rank 0 waited 2 s of its 2.5 s. Rank 0 issues its all-reduce at 4.0 while computing;
    # rank 1 joins at 4.5, so 0.125 s of rank 0's transfer (4.5-4.625) hides behind compute.
    r0 = _timeline(
        0,
        0.0,
        [
            ("comm", "broadcast", 1.0, 3.5, "world"),
            ("compute", "fwd", 3.5, 4.625, ""),
            ("comm", "all_reduce", 4.0, 4.75, "world"),
        ],
    )
    r1 = _timeline(
        1,
        2.0,
        [
            ("comm", "broadcast", 1.0, 1.5, "world"),
            ("compute", "fwd", 1.5, 2.5, ""),
            ("comm", "all_reduce", 2.5, 2.75, "world"),
        ],
    )
    assert waiting_times([r0, r1]) == [[2.0, 0.0, 0.5], [0.0, 0.0, 0.0]]
    shares = time_shares([r0, r1])
    # rank 0: 3.75 s from first to last span, waiting 2.5, moving 0.5 + 0.25
    assert shares == {
        "span": (3.75 + 1.75) / 2,
        "compute": (1.125 + 1.0) / 2,
        "waiting": 2.5 / 2,
        "transfer": (0.75 + 0.75) / 2,
        "hidden": 0.125 / 2,
    }
    # Two hosts share no clock: nothing can be called waiting.
    r1_elsewhere = {**r1, "host": "other"}
    assert waiting_times([r0, r1_elsewhere]) == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_the_timeline_sentence_says_which_took_longer_from_the_numbers():
    from fsdp_lab.markdown import timeline_sentence

    comm_heavy = {"span": 1.0, "compute": 0.3, "waiting": 0.25, "transfer": 0.5, "hidden": 0.25}
    text = timeline_sentence(comm_heavy)
    assert "more time inside collectives than computing" in text and "50% ran while" in text
    compute_heavy = {**comm_heavy, "compute": 0.9}
    assert "more time computing than inside collectives" in timeline_sentence(compute_heavy)
