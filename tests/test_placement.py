"""Where ranks compute (issue 29), with CPU stand-ins: the backend/device choice for any number of
GPUs, the start line that says it, the staging of point-to-point messages through host memory,
and the out-of-memory message of a rank sharing a GPU. What only a GPU can show runs in
`scripts/gpu_check.sh`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_lab.cluster import where
from fsdp_lab.cluster.where import Placement, resolve_placement


@pytest.mark.parametrize(
    "backend, world, device, gpus, expected",
    [
        ("auto", 2, None, 0, ("gloo", "cpu", 0, "2 rank(s) on the CPU (gloo): no GPU visible")),
        (
            "auto",
            2,
            None,
            1,
            (
                "gloo",
                "cpu",
                0,
                "2 rank(s) on the CPU (gloo): 1 GPU(s) for 2 ranks; --device cuda shares them "
                "(gloo on CUDA tensors)",
            ),
        ),
        (
            "auto",
            2,
            "cuda",
            1,
            ("gloo", "cuda", 1, "2 ranks sharing cuda:0 (gloo on CUDA tensors)"),
        ),
        (
            "auto",
            4,
            "cuda",
            2,
            ("gloo", "cuda", 2, "4 ranks sharing cuda:0, cuda:1 (gloo on CUDA tensors)"),
        ),
        ("auto", 2, None, 2, ("nccl", "cuda", 2, "2 rank(s), one GPU each (NCCL)")),
        ("auto", 2, None, 8, ("nccl", "cuda", 2, "2 rank(s), one GPU each (NCCL)")),
        ("auto", 2, "cpu", 8, ("gloo", "cpu", 0, "2 rank(s) on the CPU (gloo): --device cpu")),
        (
            "gloo",
            2,
            None,
            1,
            ("gloo", "cpu", 0, "2 rank(s) on the CPU (gloo): backend='gloo' asked for"),
        ),
        (
            "gloo",
            3,
            "cuda",
            1,
            ("gloo", "cuda", 1, "3 ranks sharing cuda:0 (gloo on CUDA tensors)"),
        ),
        ("nccl", 1, None, 1, ("nccl", "cuda", 1, "1 rank(s), one GPU each (NCCL)")),
    ],
)
def test_the_backend_and_device_follow_the_gpus_there_are(backend, world, device, gpus, expected):
    placed = resolve_placement(backend, world, device, gpus=gpus)
    assert (placed.backend, placed.device, placed.gpus, placed.why) == expected


@pytest.mark.parametrize(
    "backend, world, device, gpus, message",
    [
        (
            "nccl",
            2,
            None,
            1,
            "NCCL cannot put two ranks on one GPU). Fix: device='cuda' for 2 ranks sharing 1 GPU(s)",
        ),
        ("nccl", 2, "cpu", 2, "backend='nccl' runs on GPUs only"),
        ("auto", 2, "cuda", 0, "device='cuda' (--device cuda) but no GPU is visible"),
        ("auto", 2, "tpu", 0, "device='tpu' is not one of ('auto', 'cpu', 'cuda')"),
        ("mpi", 2, None, 0, "backend='mpi' is not one of"),
    ],
)
def test_an_impossible_placement_is_refused_with_the_fix(backend, world, device, gpus, message):
    with pytest.raises(ValueError, match="Fix|not one of|GPUs only") as err:
        resolve_placement(backend, world, device, gpus=gpus)
    assert message in str(err.value)


def test_the_environment_forces_the_cpu_lab(monkeypatch):
    monkeypatch.setenv("FSDP_LAB_DEVICE", "cpu")
    assert resolve_placement("auto", 2, gpus=4).device == "cpu"
    assert resolve_placement("auto", 2, "auto", gpus=4).backend == "nccl"  # an argument wins


def test_each_rank_gets_its_gpu_and_its_share_of_it():
    shared = Placement("gloo", "cuda", 2, "")
    assert [str(shared.device_of(r)) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert shared.memory_share(4) == 0.5 and shared.memory_share(3) == 0.5
    assert Placement("gloo", "cuda", 1, "").memory_share(4) == 0.25
    assert Placement("gloo", "cpu", 0, "").device_of(3) == torch.device("cpu")
    assert shared.shared_gpu and not Placement("nccl", "cuda", 2, "").shared_gpu


def test_a_rank_out_of_its_share_is_told_its_share_and_the_fix(monkeypatch):
    monkeypatch.setattr(where, "_PLACED", [torch.device("cuda", 0)])
    monkeypatch.setattr(where, "_SHARE", [0.25])
    monkeypatch.setattr(where, "_gpu_bytes", lambda device: 4 * 2**30)
    hint = where.out_of_memory_hint(torch.OutOfMemoryError("CUDA out of memory"))
    assert "this rank may allocate 25% of cuda:0 (1.0 of 4.0 GiB)" in hint
    assert "Fix: fewer ranks per GPU (world_size)" in hint
    assert where.out_of_memory_hint(ValueError("x")) == ""  # other errors are left as they are


def test_the_start_line_says_where_the_ranks_compute_and_why(capsys):
    from fsdp_lab import Cluster

    with Cluster(2, backend="gloo") as cluster:
        assert cluster.run(lambda: str(where.device())) == ["cpu", "cpu"]  # placed, in the rank
        why = cluster.placement.why
    line = capsys.readouterr().out
    assert "rank(s) up on gloo" in line and line.rstrip().endswith(f"): {why}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    reason = "backend='gloo' asked for" if gpus else "no GPU visible"
    assert why == f"2 rank(s) on the CPU (gloo): {reason}"


def _ring_through_host_memory(async_op: bool):
    """send/recv around the ring with staging forced (the CPU stands in for the GPU)."""
    from fsdp_lab import comm

    staged, comm._staged = comm._staged, lambda tensor, group: True
    try:
        r, n = dist.get_rank(), dist.get_world_size()
        got = torch.full((3,), -1.0)
        mine = torch.full((3,), float(r))
        with comm.CommLog() as log:
            if async_op:
                sent = comm.send(mine, dst=(r + 1) % n, async_op=True)
                received = comm.recv(got, src=(r - 1) % n, async_op=True)
                sent.wait()
                received.wait()
            elif r % 2 == 0:  # blocking around a ring: half send first, half receive first
                comm.send(mine, dst=(r + 1) % n)
                comm.recv(got, src=(r - 1) % n)
            else:
                comm.recv(got, src=(r - 1) % n)
                comm.send(mine, dst=(r + 1) % n)
    finally:
        comm._staged = staged  # the shared ranks serve other tests next
    return got.tolist(), [(x.op, x.group, x.bytes) for x in log.records]


@pytest.mark.parametrize("async_op", [False, True])
def test_point_to_point_messages_stage_through_host_memory_counted_as_such(cluster_of, async_op):
    per_rank = cluster_of(3).run(_ring_through_host_memory, async_op)
    for r, (got, records) in enumerate(per_rank):
        assert got == [float((r - 1) % 3)] * 3
        assert sorted(records) == sorted(
            [
                ("device_to_host", "staging", 12.0),  # the message, out of the device
                ("send", "ranks 0,1,2", 12.0),  # what the algorithm moves
                ("recv", "ranks 0,1,2", 12.0),
                ("host_to_device", "staging", 12.0),  # and into the device on arrival
            ]
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine's answer")
def test_asking_the_cli_for_a_gpu_that_is_not_there_is_a_usage_error(capfd):
    from fsdp_lab.cli import main

    assert main(["collectives", "--device", "cuda"]) == 2
    err = capfd.readouterr().err
    assert "device='cuda' (--device cuda) but no GPU is visible" in err
    assert "Fix" in err or "hint: device='cpu' (--device cpu)" in err


def test_nccl_with_too_few_gpus_names_the_shared_mode_as_the_fix():
    with pytest.raises(ValueError) as err:
        resolve_placement("nccl", 4, gpus=2)
    assert "world_size=4 but 2 GPU(s) found" in str(err.value)
    assert "Fix: device='cuda' for 4 ranks sharing 2 GPU(s) over gloo, or world_size=2" in str(
        err.value
    )
