"""Cluster: live ranks, results in rank order, errors that name the rank, no orphans."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import torch

import fsdp_lab
from fsdp_lab import Cluster, RankError


def _where_am_i(tag: str) -> tuple[int, int, str, str]:
    return fsdp_lab.rank(), fsdp_lab.world_size(), str(fsdp_lab.device()), tag


def _sum_of_ranks() -> float:
    import torch.distributed as dist

    x = torch.tensor([float(fsdp_lab.rank() + 1)])
    dist.all_reduce(x)
    return x.item()


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"world_size": 0}, "world_size=0"),
        ({"world_size": -2}, "world_size=-2"),
        ({"world_size": 1.5}, "int >= 1"),
        ({"world_size": "2"}, "int >= 1"),
        ({"world_size": True}, "int >= 1"),
        ({"world_size": 2, "backend": "mpi"}, "('auto', 'gloo', 'nccl')"),
        ({"world_size": 2, "timeout": 0}, "timeout=0"),
        ({"world_size": 2, "timeout": -1.0}, "> 0"),
    ],
)
def test_bad_arguments_are_value_errors_naming_the_allowed_values(kwargs, fragment):
    before = len(psutil.Process().children())
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        Cluster(**kwargs)
    assert len(psutil.Process().children()) == before  # refused before starting anything


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without enough GPUs")
def test_nccl_without_gpus_says_how_many_were_found():
    with pytest.raises(ValueError, match=r"world_size=2 but 0 GPU\(s\) found"):
        Cluster(2, backend="nccl")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_results_come_back_in_rank_order(cluster_of, n):
    cluster = cluster_of(n)
    assert cluster.backend == "gloo"
    assert cluster.run(_where_am_i, "x") == [(r, n, "cpu", "x") for r in range(n)]
    # A real collective across the ranks: 1 + 2 + ... + n on every rank.
    assert cluster.run(_sum_of_ranks) == [n * (n + 1) / 2] * n


def test_functions_defined_locally_ship_by_value(cluster_of):
    offset = 10  # captured by the closure, as a notebook cell's variable would be

    def local(k):
        return fsdp_lab.rank() * k + offset

    assert cluster_of(2).run(local, k=3) == [10, 13]
    assert cluster_of(2).run(lambda: fsdp_lab.rank() ** 2) == [0, 1]


def test_rank_output_is_forwarded_with_its_rank(cluster_of, capsys):
    cluster_of(2).run(lambda: print(f"hello from {fsdp_lab.rank()}"))
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out


def test_exception_on_one_rank_names_it_and_cluster_stays_usable(cluster_of):
    cluster = cluster_of(4)
    pids = cluster.pids

    def fails_on_two():
        if fsdp_lab.rank() == 2:
            raise ValueError("boom on purpose")
        return fsdp_lab.rank()

    with pytest.raises(RankError) as info:
        cluster.run(fails_on_two)
    assert info.value.rank == 2
    assert "ValueError: boom on purpose" in info.value.remote_traceback
    assert "fails_on_two" in info.value.remote_traceback
    assert "still usable" in str(info.value)
    assert cluster.run(_where_am_i, "again") == [(r, 4, "cpu", "again") for r in range(4)]
    assert cluster.pids == pids  # same processes: nothing was restarted


def test_a_function_that_cannot_be_shipped_is_named(cluster_of):
    lock = threading.Lock()

    def uses_a_lock():
        return lock.locked()

    with pytest.raises(TypeError, match="cannot send 'test_a_function_that_cannot_be_shipped"):
        cluster_of(2).run(uses_a_lock)


def test_a_result_that_cannot_come_back_is_a_rank_error(cluster_of):
    with pytest.raises(RankError, match="cannot be pickled"):
        cluster_of(2).run(threading.Lock)
    assert cluster_of(2).run(fsdp_lab.rank) == [0, 1]


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_hung_collective_times_out_restarts_and_leaves_no_process():
    with Cluster(2, backend="gloo", timeout=4, verbose=False) as cluster:
        old = cluster.pids

        def only_rank_zero_reduces():
            import torch.distributed as dist

            if fsdp_lab.rank() == 0:
                dist.all_reduce(torch.ones(1))  # rank 1 never joins: a hang
            return "done"

        t0 = time.monotonic()
        with pytest.raises(RankError, match=r"ranks \[0\] did not finish") as info:
            cluster.run(only_rank_zero_reduces)
        assert info.value.rank == 0
        assert time.monotonic() - t0 < 30  # the notebook got control back
        assert _alive(old) == []  # the stuck ranks were stopped
        assert cluster.run(fsdp_lab.rank) == [0, 1]  # fresh ranks on the next run
        assert set(cluster.pids).isdisjoint(old)
        new = cluster.pids
    assert _alive(new) == []


def test_a_rank_that_dies_is_reported_with_its_signal():
    with Cluster(3, backend="gloo", timeout=30, verbose=False) as cluster:
        old = cluster.pids

        def rank_one_dies():
            if fsdp_lab.rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return fsdp_lab.rank()

        with pytest.raises(RankError, match="died \\(signal SIGKILL\\)") as info:
            cluster.run(rank_one_dies)
        assert info.value.rank == 1
        assert _alive(old) == []
        assert cluster.run(fsdp_lab.rank) == [0, 1, 2]


def test_close_leaves_no_child_process():
    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}
    cluster = Cluster(4, backend="gloo", verbose=False)
    pids = cluster.pids
    assert len(_alive(pids)) == 4
    assert set(pids) <= {c.pid for c in me.children(recursive=True)}
    cluster.close()
    cluster.close()  # twice is fine
    assert _alive(pids) == []
    assert {c.pid for c in me.children(recursive=True)} - before == set()
    with pytest.raises(RuntimeError, match="closed"):
        cluster.run(fsdp_lab.rank)


def test_two_clusters_at_once_do_not_collide():
    with (
        Cluster(2, backend="gloo", verbose=False) as a,
        Cluster(2, backend="gloo", verbose=False) as b,
    ):
        assert set(a.pids).isdisjoint(b.pids)
        assert a.run(_sum_of_ranks) == [3.0, 3.0]
        assert b.run(_sum_of_ranks) == [3.0, 3.0]


class _RunsWhenUnpickled:
    """A result whose unpickling runs code: writes a file where it is unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_plain_results_cluster_reads_no_code_a_rank_sends(tmp_path):
    marker = tmp_path / "unpickled-in-the-driver"
    with Cluster(1, backend="gloo", verbose=False, plain_results=True) as cluster:
        assert cluster.run(lambda: {"x": [1, 2.5], "t": torch.ones(2)})[0]["x"] == [1, 2.5]
        with pytest.raises(RankError, match="not plain data"):
            cluster.run(lambda: _RunsWhenUnpickled(str(marker)))
        assert cluster.run(lambda: "still usable") == ["still usable"]
    assert not marker.exists()
    with Cluster(1, backend="gloo", verbose=False) as cluster:  # the default: cloudpickle
        cluster.run(lambda: _RunsWhenUnpickled(str(marker)))
    assert marker.exists()  # what plain_results is for


def test_a_line_without_end_is_read_in_linear_time_and_bounded_memory(capsys):
    """Issue 35, point 10: a rank that printed 100 MB without a newline made the driver join its
    partial line to every new chunk (quadratic time, the whole line held). A line longer than
    `MAX_LINE` is printed in pieces of at most that length, so the reader keeps at most one."""
    from fsdp_lab.cluster.output import CHUNK, MAX_LINE, RankOutput

    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    out = RankOutput(0, read_end, os.dup(2))
    held = 0
    for _ in range(64):  # 4 MiB in all, no newline
        os.write(write_end, b"x" * CHUNK)
        out.read(read_end)
        held = max(held, len(out._partial[read_end]))
    os.close(write_end)
    out.read(read_end)
    out.close()
    assert held <= MAX_LINE
    pieces = capsys.readouterr().out.splitlines()
    assert sum(len(p) - len("[rank 0] ") for p in pieces) == 64 * CHUNK  # nothing lost
    assert max(len(p) for p in pieces) <= MAX_LINE + len("[rank 0] ")
